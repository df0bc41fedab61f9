"""Text in and out: the tokenizer codec, the chat-template sandbox, tool calls."""
