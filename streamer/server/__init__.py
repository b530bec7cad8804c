"""`stream-run serve`: an OpenAI-compatible HTTP server over one Session (starlette on uvicorn, the `[serve]`
extra). text: chat rendering, stop strings, <think> splitting; schemas: request validation and error bodies;
engine: the single generation worker, its FIFO queue and prompt-prefix reuse; metrics: Prometheus text;
app: the routes."""
