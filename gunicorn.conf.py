# gunicorn reads this file from the working directory: `gunicorn server.app` serves the OpenAI API.
# The settings live in server/gunicorn_conf.py (also used by `python -m server`).
from server.gunicorn_conf import *  # noqa: F401,F403
