"""Frontend: tokenizer, chat templates with message endpoints, incremental detokenizer.

Public API:
- ``ChatTemplate``: a compiled chat template rendering like transformers' apply_chat_template.
- ``Frontend`` (``Frontend.load``), ``TokenSettings``, ``RenderedChat``: one model's tokenizer,
  template and token settings; ``render_chat`` returns prompt text, token ids and message endpoints.
- ``IncrementalDecoder``, ``StopStringMatcher``, ``Detokenizer``: token ids back to text.
- ``tokenizer_from_gguf``: a tokenizer.json (and template, special tokens) from a GGUF file.
"""

from flared.frontend.detokenizer import Detokenizer, IncrementalDecoder, StopStringMatcher, TextDelta
from flared.frontend.frontend import EndpointStrategy, Frontend, RenderedChat, TokenSettings
from flared.frontend.gguf_tokenizer import GGUFTokenizerAssets, tokenizer_from_gguf
from flared.frontend.template import ChatTemplate, RenderedTemplate

__all__ = [
    "ChatTemplate",
    "Detokenizer",
    "EndpointStrategy",
    "Frontend",
    "GGUFTokenizerAssets",
    "IncrementalDecoder",
    "RenderedChat",
    "RenderedTemplate",
    "StopStringMatcher",
    "TextDelta",
    "TokenSettings",
    "tokenizer_from_gguf",
]
