"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/<id>`) over the chat service.

A Responses request is validated here (request.py), turned into a chat completion request (items.py,
convert.py), answered by the chat service, and its chat body or chunks are rendered as a Response
object (output.py) or the Responses event stream (events.py). Stored responses live in a bounded
store per model and worker (store.py); service.py ties these together, routes.py is the blueprint.
"""
