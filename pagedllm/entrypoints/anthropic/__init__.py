"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): a translation layer
over /v1/chat/completions' handler (pagedllm/entrypoints/openai/chat_bridge.py)."""
