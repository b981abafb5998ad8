"""The chat page flared serves at ``/`` (as llama.cpp's server serves its web UI): index.html and chat.js, no
outside assets. chat.js talks to /v1/chat/completions like any other client; tests/api/test_webui.py runs its
request code under Node against a daemon where Node is installed."""
