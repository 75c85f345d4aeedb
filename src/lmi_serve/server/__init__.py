"""The process and its HTTP layer: gunicorn, the Flask app and its middleware, security, metrics, OpenAPI."""
