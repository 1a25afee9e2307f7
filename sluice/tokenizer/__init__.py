"""The HTTP process's side of a request: normalization, tokenization, chat templates, ReqState."""
