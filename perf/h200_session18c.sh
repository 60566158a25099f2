#!/bin/sh
# The third H200 call of session 18 (~6 minutes): the 32-layer end to end against the gpt-fast-style peer again,
# now with JITKERN_SERIAL_CHAIN off (the second call ran with it on, and it is slower at prefill sizes: 1 CTA an SM),
# then the CUPTI sums at the defaults.
# Run from the repo root after the device README's setup: sh perf/h200_session18c.sh
set -u
sh perf/h200_e2e.sh
left=$((590 - SECONDS))
[ $left -gt 60 ] && timeout $left sh perf/h200_profile.sh
