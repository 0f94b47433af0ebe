"""The v1 HTTP API: ``create_app(app)`` returns the FastAPI app (see API.md)."""

from kiln.api.app import RedactAccessToken, create_app, install_log_redaction

__all__ = ["RedactAccessToken", "create_app", "install_log_redaction"]
