"""`pyinfer serve`: an OpenAI-compatible HTTP server with a chat page, on Starlette and uvicorn.

`launch` loads the model and runs uvicorn; `app` holds the routes; `engine` runs the queued requests one at a
time on a thread of its own; `schemas` validates request bodies; `openai_errors` shapes every failure as
OpenAI's error object; `metrics` counts for Prometheus; `static/index.html` is the chat page.
"""
