// llama.cpp driven over a pipe, for perf/bench.py's `--peer llama.cpp-static`: the same low-level calls as
// bench.py's LlamaCppRunner makes through llama-cpp-python, in a small C++ program linked statically against
// the llama.cpp libraries that `make peer-server` builds (.peers/build-server): a peer for when
// llama-cpp-python is not installed. Timestamps are taken in here (CLOCK_MONOTONIC), so the pipe's cost is
// outside every timed window.
//
// Build (bench.py does it when the binary is missing):
//   g++ -O2 -std=c++17 perf/peers/llama_cpp_pipe.cpp -I$SRC/include -I$SRC/ggml/include \
//     .peers/build-server/src/libllama.a .peers/build-server/ggml/src/libggml.a \
//     .peers/build-server/ggml/src/libggml-cpu.a .peers/build-server/ggml/src/libggml-base.a -fopenmp -lpthread \
//     -o .peers/llama-cpp-pipe          (SRC = the vendored llama.cpp of .peers/llama_cpp_python-*)
// Usage: llama-cpp-pipe MODEL THREADS N_BATCH PER_SEQ_CTX
// Protocol (stdin -> stdout, one line each): "gen C MAX_TOKENS" then C lines "N tok1 .. tokN";
// answer "ok T_ARRIVAL T_FIRST T_LAST" then C lines of generated tokens (greedy argmax). "info" -> one line of
// llama_print_system_info and the flash-attention type. "quit" ends.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

static double now() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

struct Ctx { llama_context * ctx; llama_batch batch; llama_memory_t mem; int flash; };

int main(int argc, char ** argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL THREADS N_BATCH PER_SEQ_CTX\n", argv[0]);
        return 2;
    }
    const int threads = atoi(argv[2]), n_batch = atoi(argv[3]), per_seq = atoi(argv[4]);
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (!model) { fprintf(stderr, "llama.cpp could not load %s\n", argv[1]); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::map<int, Ctx> ctxs;
    auto context = [&](int n_seq) -> Ctx & {
        auto it = ctxs.find(n_seq);
        if (it != ctxs.end()) return it->second;
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = per_seq * n_seq;
        cp.n_batch = n_batch;
        cp.n_ubatch = cp.n_ubatch < (uint32_t) n_batch ? cp.n_ubatch : n_batch;
        cp.n_seq_max = n_seq;
        cp.n_threads = threads;
        cp.n_threads_batch = threads;
        cp.no_perf = true;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) { fprintf(stderr, "llama.cpp could not create a context\n"); exit(1); }
        llama_batch b = llama_batch_init(n_batch > n_seq ? n_batch : n_seq, 0, n_seq);
        return ctxs[n_seq] = Ctx{ctx, b, llama_get_memory(ctx), (int) cp.flash_attn_type};
    };
    struct Item { int tok, pos, seq; bool want; };
    auto decode = [&](Ctx & c, const std::vector<Item> & items, size_t a, size_t n) {
        c.batch.n_tokens = (int) n;
        for (size_t k = 0; k < n; k++) {
            const Item & it = items[a + k];
            c.batch.token[k] = it.tok; c.batch.pos[k] = it.pos; c.batch.n_seq_id[k] = 1;
            c.batch.seq_id[k][0] = it.seq; c.batch.logits[k] = it.want;
        }
        int rc = llama_decode(c.ctx, c.batch);
        if (rc != 0) { fprintf(stderr, "llama_decode failed with %d\n", rc); exit(1); }
    };
    auto argmax = [&](Ctx & c, int k) {
        const float * l = llama_get_logits_ith(c.ctx, k);
        int best = 0;
        for (int v = 1; v < n_vocab; v++) if (l[v] > l[best]) best = v;
        return best;
    };
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream hs(line);
        std::string cmd;
        hs >> cmd;
        if (cmd == "quit") break;
        if (cmd == "info") {
            printf("%s | flash_attn_type %d\n", llama_print_system_info(), ctxs.empty() ? -2 : ctxs.begin()->second.flash);
            fflush(stdout);
            continue;
        }
        int C = 0, max_tokens = 0;
        hs >> C >> max_tokens;
        std::vector<std::vector<int>> prompts(C);
        for (int s = 0; s < C; s++) {
            std::getline(std::cin, line);
            std::istringstream ps(line);
            int n; ps >> n;
            prompts[s].resize(n);
            for (int i = 0; i < n; i++) ps >> prompts[s][i];
        }
        Ctx & c = context(C);
        llama_memory_clear(c.mem, true);
        const double ta = now();
        // all prompts (seq ids 0..) in batches of n_batch tokens; the last token of each wants logits
        std::vector<Item> items;
        for (int s = 0; s < C; s++)
            for (int p = 0; p < (int) prompts[s].size(); p++)
                items.push_back({prompts[s][p], p, s, p == (int) prompts[s].size() - 1});
        std::vector<std::vector<int>> out(C);
        for (size_t a = 0; a < items.size(); a += n_batch) {
            size_t n = items.size() - a < (size_t) n_batch ? items.size() - a : (size_t) n_batch;
            decode(c, items, a, n);
            for (size_t k = 0; k < n; k++)
                if (items[a + k].want) out[items[a + k].seq].push_back(argmax(c, (int) k));
        }
        const double tf = now();
        std::vector<int> pos(C);
        for (int s = 0; s < C; s++) pos[s] = (int) prompts[s].size();
        std::vector<Item> step(C);
        for (int t = 0; t < max_tokens - 1; t++) {
            for (int s = 0; s < C; s++) step[s] = {out[s].back(), pos[s], s, true};
            decode(c, step, 0, C);
            for (int s = 0; s < C; s++) { out[s].push_back(argmax(c, s)); pos[s]++; }
        }
        const double tl = now();
        printf("ok %.9f %.9f %.9f\n", ta, tf, tl);
        for (int s = 0; s < C; s++) {
            for (size_t i = 0; i < out[s].size(); i++) printf(i ? " %d" : "%d", out[s][i]);
            printf("\n");
        }
        fflush(stdout);
    }
    for (auto & kv : ctxs) { llama_batch_free(kv.second.batch); llama_free(kv.second.ctx); }
    llama_model_free(model);
    return 0;
}
