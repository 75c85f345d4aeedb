"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat service.

schema.py validates the body (Anthropic refuses unknown fields, and so does this dialect), convert.py
turns it into the neutral chat request the OpenAI chat service prepares for the engine, render.py
turns the engine's events into Anthropic's stream events (a whole message is those events added
up), service.py runs one request, errors.py is the error table, routes.py the blueprint.
docs/anthropic.md lists every field: honoured, accepted without effect, or refused.
"""
