"""The OpenAI-compatible HTTP API of `jaxinfer serve`: request bodies (`protocol`), their translation to engine
inputs (`translate`), response bodies (`responses`) and the FastAPI application (`app`)."""
