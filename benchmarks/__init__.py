"""The peer harness of `kvgen bench`, kept out of the kvgen package: what drives other engines and
llama.cpp's tools, which a user of kvgen installs none of (kvgen.bench.harness finds it in a checkout).

    peers.py          transformers, llama-cpp-python, CTranslate2 (and their prompt-lookup modes)
    llama_server.py   llama.cpp's own server, started per slot count
    models.py         the generated models by name (smollm2-135m, llama-1b:Q4_K_M, ...) and each
                      model in the form each peer loads (a GGUF, a plain HF directory)
    random_models.py  seeded random weights in a real architecture's shape, quantized by llama.cpp
    llama_tools.py    llama.cpp's converter and binaries, found or fetched once
    page.py           BENCHMARKS.md, rendered from the JSON files of kvgen bench latency / throughput
"""
