"""The sampling layer: logits to tokens (sampler.py), speculative tokens verified (rejection.py), and the
grammars of structured outputs that mask a row's logits (grammar.py). It reads requests through
`kvgen.sampling_params`, and imports only the layers below it (cache, model, loaders, config)."""
