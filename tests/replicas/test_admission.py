"""The replicas' front end admits a request once (kvgen.engine.admission), and a replica queues the
admitted request as it comes, without checking it again."""

from __future__ import annotations

import asyncio
import pickle
from collections import deque

from kvgen import LLM, SamplingParams
from kvgen.config import EngineConfig
from kvgen.replicas.frontend import ReplicaSet
from kvgen.replicas.replica import Channel, _serve
from tests.conftest import ADMISSION_RULES

PARAMS = SamplingParams(temperature=0, max_tokens=6, n=2, kv_policy="window:32")


class Connection:
    """The replica's end of the front end's connection: `incoming` messages, then what it sent."""

    def __init__(self, incoming: list[tuple]) -> None:
        self.incoming, self.sent = deque(incoming), []

    def poll(self, timeout: float = 0) -> bool:
        return bool(self.incoming)

    def recv(self) -> tuple:
        return self.incoming.popleft() if self.incoming else ("close",)

    def send(self, message: tuple) -> None:
        self.sent.append(message)


def test_a_replica_queues_admitted_requests_without_admitting_them_again(admissions):
    engine = LLM(num_kv_blocks=64).engine
    sent = [pickle.loads(pickle.dumps(engine.admission.admit(p, PARAMS))) for p in ("Once upon a time", "Tom")]
    assert all(a.grammar is None and a.prompt is None and a.policy.spec == "window:32" for a in sent)
    admissions.clear()
    conn = Connection([("add", f"r{i}", admitted) for i, admitted in enumerate(sent)])
    _serve(engine, Channel(conn))
    finished = [out for kind, *rest in conn.sent if kind == "outputs" for out in rest[0] if out.finished]
    assert sorted(out.request_id for out in finished) == ["r0", "r1"]
    assert all(len(out.outputs) == 2 and out.outputs[0].token_ids for out in finished)
    assert admissions == {}  # no rule ran again, no policy was parsed again


def test_the_front_end_admits_each_request_once(admissions):
    replicas = ReplicaSet(model=None, config=EngineConfig(num_kv_blocks=64, max_num_seqs=4), num_replicas=1)

    async def run() -> list[str]:
        streams = [replicas.generate(p, PARAMS) for p in ("Once upon a time", "Tom", [1, 400])]
        texts = []
        for stream in streams:
            async for out in stream:
                pass
            texts.append(out.outputs[1].text)
        return texts

    try:
        admissions.clear()
        assert all(asyncio.run(run()))
    finally:
        replicas.close()
    assert admissions["admit"] == 3
    assert {rule: admissions[rule] for rule in ADMISSION_RULES} == {rule: 3 for rule in ADMISSION_RULES}
    assert admissions["parse"] == 0  # PARAMS parsed its policy once, when it was made
