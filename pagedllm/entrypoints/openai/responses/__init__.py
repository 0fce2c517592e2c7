"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}): a translation layer over
/v1/chat/completions' handler (pagedllm/entrypoints/openai/chat_bridge.py)."""
