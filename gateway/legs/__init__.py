"""Running the legs of one request on a chosen pair: SGLang's two calls at once or vLLM's
one after the other, with retries on a new pair, breakers and the request deadline."""
