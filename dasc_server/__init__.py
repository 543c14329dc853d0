"""OpenAI-compatible HTTP/SSE front end (FastAPI + uvicorn). Filled by the serving-engine work."""
