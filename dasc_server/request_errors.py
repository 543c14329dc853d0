"""Refusals of the HTTP front end as OpenAI words them: ``RequestError`` and the body
``{"error": {message, type, param, code}}`` every refusal becomes."""

from __future__ import annotations

INVALID_REQUEST = "invalid_request_error"


class RequestError(Exception):
    """A request refused before or while it runs; rendered by ``error_body``."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = INVALID_REQUEST, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = INVALID_REQUEST,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error_body(errors: list[dict]) -> dict:
    """Turn pydantic/FastAPI validation errors into one OpenAI-style 400 body."""
    parts, param = [], None
    for err in errors:
        if err.get("type") == "json_invalid":  # its loc is a character position, not a field
            parts.append(f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
            continue
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return error_body("; ".join(dict.fromkeys(parts)) or "invalid request", param=param)
