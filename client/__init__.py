"""HTTP/SSE client for the dasc front end."""
