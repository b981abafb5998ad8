"""Frontend: tokenizer, chat templates with message endpoints, incremental detokenizer."""

from flared.frontend.template import ChatTemplate, RenderedTemplate

__all__ = ["ChatTemplate", "RenderedTemplate"]
