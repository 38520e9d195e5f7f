"""One admission: every rule a request must meet, checked once, before any engine takes it.

    prompt, SamplingParams --Admission.admit--> AdmittedRequest (token ids, resolved cache policy,
                                                 compiled grammar)
        LLM.generate, LLMEngine.add_request      admit, then engine.add_admitted
        AsyncLLM.generate                        admit at once (a bad request raises to the caller),
                                                 engine.add_admitted between two steps
        ReplicaSet.generate                      admit in the front end, then the replica's engine
                                                 takes the admitted request as it is
        the server (kvgen.server.jobs)           admit each prompt, then hand the admitted requests on

The rules: the prompt's token ids lie in the vocabulary (an empty prompt starts from BOS); the cache
policy suits the model (a sliding-window model gets its window by default; a hybrid one refuses sinks
and h2o) and where it runs (tensor parallelism refuses h2o); fields naming tokens stay inside the
vocabulary; speculation is asked of an engine that has it, with a policy it composes with; prompt +
max_tokens fits the context (a sinks policy runs past it); the sequence fits the KV pools at its peak;
a reference engine (contiguous / no cache) runs only the model's own policy; the grammar compiles.

A request's kv_policy is parsed once, when its SamplingParams are made (`SamplingParams.cache_policy`);
the policy resolved here travels on the request and its sequences.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvgen.cache.hybrid import HybridKVManager
from kvgen.cache.kv_manager import KVCacheManager
from kvgen.cache.policies import CachePolicy
from kvgen.config import EngineConfig, ModelConfig
from kvgen.engine.speculative.speculator import UNSPECULATED_POLICIES
from kvgen.errors import InvalidRequestError
from kvgen.sample.grammar import Grammar, GrammarCompiler
from kvgen.sampling_params import SamplingParams
from kvgen.tokenizer import Tokenizer

Prompt = str | list[int]


def max_model_len_of(model: ModelConfig, config: EngineConfig) -> int:
    """The context an engine serves: `max_model_len` if set, never past the model's positions."""
    return min(config.max_model_len or model.max_position_embeddings, model.max_position_embeddings)


@dataclass(frozen=True)
class EncodedPrompt:
    """A prompt as `Admission.encode` made it, its ids checked: admitted later without encoding it again
    (the server sizes max_tokens by the longest prompt first)."""

    token_ids: list[int]
    text: str | None = None


@dataclass
class AdmittedRequest:
    """A request that passed admission: what an engine needs to queue it without checking it again.
    Sent to another process (a replica), it leaves behind its compiled grammar, which `Admission.restore`
    compiles there again from the GrammarSpec, and the prompt's text, which the replica's outputs would
    otherwise carry back after every step."""

    token_ids: list[int]
    params: SamplingParams
    policy: CachePolicy  # resolved for the model and the engine
    grammar: Grammar | None = None
    prompt: str | None = None  # the prompt's text, when it came as text

    def __getstate__(self) -> dict:
        return {**self.__dict__, "grammar": None, "prompt": None}


@dataclass(frozen=True)
class KVLimits:
    """What the paged engine's pools take: a sequence must fit `tables` at its peak, which with a
    bounded policy is what it keeps plus one step's `chunk` of tokens."""

    tables: KVCacheManager | HybridKVManager
    capacity_tokens: int
    chunk: int
    state_slots: int | None = None  # a recurrent model's: the most completions (n) one request may run


class Admission:
    """The rules of a valid request for one engine: its model, context, KV pools (None: a reference
    engine, which runs only the model's own policy), speculation, and what its executor refuses."""

    def __init__(self, tokenizer: Tokenizer, model: ModelConfig, max_model_len: int,
                 kv: KVLimits | None = None, speculative: bool = False,
                 policy_refusal: Callable[[CachePolicy], str | None] = lambda _: None,
                 grammars: GrammarCompiler | None = None) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.max_model_len = max_model_len
        self.kv = kv
        self.speculative = speculative
        self.policy_refusal = policy_refusal
        self.grammars = grammars or GrammarCompiler(tokenizer, model.vocab_size)
        self.default_policy = self._for_model(CachePolicy())

    def admit(self, prompt: Prompt | EncodedPrompt, params: SamplingParams) -> AdmittedRequest:
        """Checks every rule once; raises InvalidRequestError for a request that could never be served."""
        encoded = prompt if isinstance(prompt, EncodedPrompt) else self.encode(prompt)
        token_ids = encoded.token_ids
        policy = self.resolve_policy(params)
        self._check_token_fields(params)
        self._check_speculative(params, policy)
        self._check_context(len(token_ids), params, policy)
        if self.kv is not None:
            self._check_pool(len(token_ids), params, policy)
        elif policy != self.default_policy:
            raise InvalidRequestError(f"kv_policy {params.kv_policy} needs the paged KV cache (--kv-cache paged)")
        return AdmittedRequest(token_ids, params, policy, self.compile_grammar(params), encoded.text)

    def restore(self, admitted: AdmittedRequest) -> AdmittedRequest:
        """The request with its grammar compiled in this process, when it came from another."""
        if admitted.grammar is None and admitted.params.grammar is not None:
            admitted.grammar = self.compile_grammar(admitted.params)
        return admitted

    # -- the rules ------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> EncodedPrompt:
        """Text -> ids (BOS first when the model wants it); ids are checked against the vocabulary; an
        empty prompt means "start from BOS"."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            token_ids = list(prompt)
            vocab = self.model.vocab_size
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not token_ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise InvalidRequestError("the prompt is empty and the model has no BOS token to start from")
            token_ids = [bos]
        return EncodedPrompt(token_ids, prompt if isinstance(prompt, str) else None)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """`encode(prompt)`'s token ids."""
        return self.encode(prompt).token_ids

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's compiled grammar, if it has one; raises InvalidRequestError for a schema or
        regex that does not compile (compiled grammars are cached, so a second call is cheap)."""
        return None if params.grammar is None else self.grammars.compile(params.grammar)

    def resolve_policy(self, params: SamplingParams) -> CachePolicy:
        """The request's cache policy for this model and executor (see `_for_model`)."""
        policy = self._for_model(params.cache_policy)
        refusal = self.policy_refusal(policy)
        if refusal is not None:
            raise InvalidRequestError(refusal)
        return policy

    def _for_model(self, policy: CachePolicy) -> CachePolicy:
        """Models with a sliding window get it unless told otherwise. On a hybrid model (Gemma 3)
        `window:W` bounds every layer by W (windowed layers by the smaller window); sinks re-rotate
        keys by cache rank and h2o ranks keys over every layer, neither of which a hybrid cache's
        kinds share, so they are refused."""
        window = self.model.sliding_window
        if policy.kind == "full" and window is not None:
            return CachePolicy("window", window=window)
        if self.model.is_hybrid and policy.kind in ("sinks", "h2o"):
            raise InvalidRequestError(f"kv_policy {policy.spec} does not combine with this model's own sliding-window "
                                      "layers (full and window:W do)")
        return policy

    def _check_token_fields(self, params: SamplingParams) -> None:
        """Fields that name tokens, or count them, stay inside the vocabulary."""
        vocab = self.model.vocab_size
        if params.top_k > vocab:
            raise InvalidRequestError(f"top_k is {params.top_k}, more than the vocabulary of {vocab} tokens "
                                      "(0 or -1 turns top-k off)")
        for field, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise InvalidRequestError(f"{field} names token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def _check_speculative(self, params: SamplingParams, policy: CachePolicy) -> None:
        """Insisting on speculation needs an engine that speculates; one that does refuses the
        policies speculation does not compose with (kvgen.engine.speculative.speculator), unless the request
        opts out."""
        if self.speculative:
            if policy.kind in UNSPECULATED_POLICIES and params.speculative is not False:
                raise InvalidRequestError(f"kv_policy {policy.spec} does not compose with speculative decoding "
                                          "(rejected tokens would stay in its ranks or scores); send speculative: "
                                          "false with it, or run without speculative decoding")
        elif params.speculative:
            raise InvalidRequestError("speculative is set, but this engine runs without speculative decoding "
                                      "(start it with --speculative-method ngram, draft or suffix)")

    def _check_context(self, num_prompt_tokens: int, params: SamplingParams, policy: CachePolicy) -> None:
        total = num_prompt_tokens + params.max_tokens
        if policy.uses_cache_positions:
            if policy.max_kept > self.max_model_len:
                raise InvalidRequestError(f"kv_policy {policy.spec} keeps {policy.max_kept} tokens, more than "
                                          f"the model's context of {self.max_model_len} tokens")
        elif total > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} tokens "
                f"exceeds the model's context of {self.max_model_len} tokens"
                + ("" if policy.kind != "full" else "; a bounded kv_policy such as sinks:4,508 can run longer"))

    def _check_pool(self, num_prompt_tokens: int, params: SamplingParams, policy: CachePolicy) -> None:
        if self.kv.state_slots is not None and params.n > self.kv.state_slots:
            raise InvalidRequestError(f"n = {params.n} completions exceed the {self.kv.state_slots} state slots")
        total = num_prompt_tokens + params.max_tokens
        peak = self._peak_tokens(total, policy)
        if not self.kv.tables.fits(peak):
            need = (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} tokens"
                    if peak == total else f"kv_policy {params.kv_policy} holds up to {peak} tokens at once, which")
            raise InvalidRequestError(f"{need} exceeds the KV cache capacity of {self.kv.capacity_tokens} tokens")

    def _peak_tokens(self, total: int, policy: CachePolicy) -> int:
        """Most KV slots one sequence can hold at once: all its tokens, or what its policy keeps plus
        one step's chunk and a block of slack on each side of a gap. Heavy hitters may lie in as
        many blocks as there are of them, each held for the one token."""
        if policy.max_kept is None:
            return total
        block_size = self.kv.tables.block_size
        kept = policy.max_kept + policy.heavy * (block_size - 1)
        return min(total, kept + self.kv.chunk + 2 * block_size)
