"""A flood through the real tritonserver onto the batched engine: every request is answered, or refused at
once with the busy error while the engine's queue is full; the batch gives each answer the tokens it gets
alone; the server serves normally afterwards."""

from __future__ import annotations

import threading

from conftest import convert_and_build

from pipeline.client.client import Sampling, TritonRequestError, generate_ids
from pipeline.triton.repo import write_repository
from pipeline.triton.server import TritonServer, free_ports

MAX_BATCH, MAX_QUEUE = 2, 4
FLOOD = 10 * (MAX_BATCH + MAX_QUEUE)
PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17])
MAX_TOKENS = 24


def test_a_flood_of_ten_times_capacity_gets_answers_or_busy_errors(tiny_llama_dir, tmp_path):
    engine = convert_and_build(tiny_llama_dir, tmp_path / "build")
    repo = write_repository(engine, tmp_path / "repo", serving={"max_batch_size": MAX_BATCH, "max_queue": MAX_QUEUE})
    sampling = Sampling(max_tokens=MAX_TOKENS, end_id=-1)
    with open(tmp_path / "tritonserver.log", "w") as log, TritonServer(repo, free_ports(), log=log) as server:
        alone = [generate_ids(server.grpc_url, ids, sampling, stream=True).output_ids for ids in PROMPTS]
        answers: list[tuple[int, list[int]]] = []
        refusals: list[str] = []
        lock = threading.Lock()
        start = threading.Barrier(FLOOD)

        def client(i: int) -> None:
            start.wait()
            try:
                ids = generate_ids(server.grpc_url, PROMPTS[i % len(PROMPTS)], sampling, stream=True).output_ids
                with lock:
                    answers.append((i, ids))
            except TritonRequestError as exc:
                with lock:
                    refusals.append(str(exc))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(FLOOD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(answers) + len(refusals) == FLOOD
        assert answers and refusals, (len(answers), refusals[:3])
        assert all("busy" in r for r in refusals), refusals[:3]
        assert all(ids == alone[i % len(PROMPTS)] for i, ids in answers)
        after = generate_ids(server.grpc_url, PROMPTS[0], sampling, stream=True)
        assert after.output_ids == alone[0]
    log_text = (tmp_path / "tritonserver.log").read_text()
    assert f'"max_batch_size": {MAX_BATCH}' in log_text and "kv_cache_tokens" in log_text
