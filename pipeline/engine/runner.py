"""The portable engine: load an engine directory, then serve requests through the scheduler.

Plain engines batch every request in flight over the paged KV cache (scheduler.py -> step.py -> model);
speculative engines whose proposer has a batched form (EAGLE, EAGLE-3, Medusa, n-gram) do too, in
speculative steps of adaptive tiers (spec_step.py, adaptive.py). The draft model, and any engine built
with `SchedulerConfig(batched=False)`, serve one request at a time through this module's decode loop:
validate -> prefill (target over the prompt, first token) -> loop:
  propose (tree) -> verify (one target pass over the tree) -> accept (path + bonus token)
  -> compact the accepted path's KV -> one host copy of the new tokens -> stop checks -> stream.
On CUDA, greedy requests whose proposer reads only device state (EAGLE, Medusa) queue up to
run_ahead steps before that host copy, the cache length staying on the device meanwhile, and the next
group is queued before the host reads the current one (readback.py).
Plain decoding through this loop is the same loop with a one-node tree.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import cast

import torch

from pipeline.engine import onednn
from pipeline.engine.acceptance import Acceptance, accept_greedy, accept_sampling, accept_typical
from pipeline.engine.config import EngineLimits, SpecConfig
from pipeline.engine.cpu_threads import on_own_thread
from pipeline.engine.graphs import MAX_PREFILL_TOKENS, Compiled, GraphedTarget, prefill_bucket, prefill_buckets
from pipeline.engine.kernels.routing import attach
from pipeline.engine.kv_cache import BlockPool
from pipeline.engine.model import KVCache, Transformer, full_slot_context, make_context
from pipeline.engine.readback import Pending, Readback
from pipeline.engine.request import GenerationResult, RequestStream, StopChecker, StreamChunk
from pipeline.engine.sampling import RequestError, SamplingParams, argmax_rows, choose
from pipeline.engine.scheduler import Scheduler, SchedulerConfig
from pipeline.engine.spec_step import BatchProposer, SpecStep
from pipeline.engine.speculative import BufferDrafter, PlainProposer, Proposer, StepInput, TargetPass
from pipeline.engine.stats import SpecStats
from pipeline.engine.step import BatchStep
from pipeline.engine.tree import DraftTree

WARMUP_NEW_TOKENS = 8
# Rows a step runs at least on CUDA when serving sets no --max-batch-size: an engine's build value (8 by
# default, sized for a CPU) would leave a GPU queueing requests it could batch.
CUDA_MAX_BATCH_SIZE = 64
# Greedy steps queued between host reads on CUDA (plain, EAGLE and Medusa): streaming then arrives
# in groups of this many steps, and an end id costs at most the steps of two groups (the one read and
# the one queued behind it), discarded.
RUN_AHEAD_STEPS = 8  # a few steps: the first step of each graph size compiles and captures it
# The steps queued ahead of the host cover at most this share of those the request is still expected to
# need (at the tokens a step has emitted so far), so that the queue shrinks toward the request's end
# instead of running past it. SmolLM2 + EAGLE-3, 10 MT-bench first turns of 256 tokens, steps counted
# on the CPU at 8 steps ahead: sized for one token a step, 10.1 steps a request ran past its end; for
# all of the expected steps 5.2; for half 0.8, with 0.2 reads a request that found nothing queued behind
# (the device idles until the host queues more). Medusa: 5.5 past the end against 0.0 (0.9 such reads).
QUEUE_SHARE = 0.5


def default_batch_size(built: int, device: torch.device) -> int:
    """Rows a step runs when serving sets none: the engine's build value, on CUDA at least CUDA_MAX_BATCH_SIZE."""
    return max(built, CUDA_MAX_BATCH_SIZE) if device.type == "cuda" else built


# A speculative proposer's batched form, made once the pool's size is known:
# (pool blocks, block size, proposer-state rows, max tree nodes) -> BatchProposer.
RowsFactory = Callable[[int, int, int, int], BatchProposer]

__all__ = ["Engine", "GenerationResult", "RequestError", "SamplingParams", "StreamChunk", "SpecStats"]


def warm_up_prompt_lengths(limits: EngineLimits, max_prefill_tokens: int = MAX_PREFILL_TOKENS) -> list[int]:
    """One prompt length for each prefill bucket a request of these limits can reach."""
    longest = max(1, min(limits.max_input_len, limits.max_seq_len - WARMUP_NEW_TOKENS))
    top = prefill_bucket(longest, max_prefill_tokens) or max_prefill_tokens
    return [min(bucket, longest) for bucket in prefill_buckets(top)]


def prepare_kernels(module: torch.nn.Module, invariant: bool = False) -> None:
    """Route a loaded network's products and attention to this device's kernels: oneDNN with
    prepacked weights on the CPU, our Triton kernels on CUDA (targets and drafts alike); `invariant`:
    the batch-invariant ones (CUDA)."""
    if next(module.parameters()).device.type == "cpu":
        onednn.pack(module)
    else:
        attach(module, invariant=invariant)


@dataclass
class _Steps:
    """Speculative steps queued on the device."""

    trees: list[DraftTree]
    accepted: Pending  # [steps, max_depth + 2]: each step's accepted tokens and bonus, then its count
    root: torch.Tensor  # [1] the last step's bonus token: the next step's root
    length: int | torch.Tensor  # the cache length after the steps (a host int only for one step at a time)
    last: tuple[DraftTree, Acceptance, TargetPass]  # the last step's, for a proposer updated from the host

    @property
    def steps(self) -> int:
        return len(self.trees)


class Engine:
    def __init__(
        self,
        target: Transformer,
        tokenizer,
        limits: EngineLimits,
        spec: SpecConfig,
        proposer: Proposer | None = None,
        serving: SchedulerConfig | None = None,
        rows: RowsFactory | None = None,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.limits = limits
        self.spec = spec
        self.device = target.lm_head.weight.device
        self.proposer: Proposer = proposer or PlainProposer(self.device)
        serving = serving or SchedulerConfig()
        # Plain engines, and speculative ones with a batched proposer (`rows`), batch every request in
        # flight over the block pool; others serve one request at a time on a cache of one sequence,
        # through _decode. `serving.batched` False puts any engine on that path (the single-stream
        # benchmarks measure it there).
        plain = isinstance(self.proposer, PlainProposer)
        self.batched = serving.batched and (plain or rows is not None)
        self.cache = target.new_cache(limits.max_seq_len + self.proposer.max_nodes)
        # CUDA graphs for decode and verification steps; the CPU path stays eager. Set to None to
        # run a CUDA engine eagerly (the benchmark does, to show what the graphs buy).
        self.graphs: GraphedTarget | None = None
        # Before capture: the graphs record whichever kernels the layers call.
        prepare_kernels(target, serving.invariant)
        if serving.invariant:  # fused elementwise chains round to the dtype between ops, as unfused ones do
            import torch._inductor.config as inductor_config

            inductor_config.emulate_precision_casts = True
        if self.device.type == "cuda" and not self.batched:
            self.graphs = GraphedTarget(target, self.cache, self.proposer.capture_layers)
        self.run_ahead = RUN_AHEAD_STEPS if self.device.type == "cuda" else 1
        self.slot_offsets = torch.arange(self.proposer.max_nodes, device=self.device)
        # hidden [N, H] -> greedy tokens [N], compiled on CUDA: the LM head, then the argmax in two
        # parallel stages (one reduction over the vocabulary runs on one block).
        self.greedy = Compiled(
            lambda hidden: argmax_rows(self.target.logits(hidden)), None if self.device.type == "cuda" else False
        )
        self.readback = Readback()  # host copies of queued steps
        self.max_batch_size = serving.max_batch_size or default_batch_size(limits.max_batch_size, self.device)
        self.pool: BlockPool | None = None
        step = None
        if self.batched:
            cfg = target.cfg
            bytes_per_token = (
                2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * target.lm_head.weight.element_size()
            )
            # A tree past the text, after the drafts a step in flight may have accepted (SpecStep.headroom).
            headroom = 0 if plain else 2 * (limits.max_draft_len + 1)
            blocks = serving.cache.num_blocks(
                bytes_per_token, self.device, self.max_batch_size, limits.max_seq_len + headroom
            )
            self.pool = BlockPool(
                cfg.num_layers,
                blocks,
                serving.cache.block_size,
                cfg.num_kv_heads,
                cfg.head_size,
                target.lm_head.weight.dtype,
                self.device,
            )
            if plain:
                step = BatchStep(target, self.pool, self.max_batch_size, limits.max_seq_len)
            else:
                assert rows is not None
                batch_proposer = rows(blocks, serving.cache.block_size, self.max_batch_size + 1, headroom)
                step = SpecStep(
                    target,
                    self.pool,
                    batch_proposer,
                    self.max_batch_size,
                    limits.max_seq_len,
                    compile_tiers=serving.compile_tiers,
                    compile_rows=serving.compile_tier_rows,
                )
        self.scheduler = Scheduler(
            serving, self.max_batch_size, step, self.result, self.stop_checker, None if self.batched else self._serial
        )

    @property
    def capacity(self) -> dict[str, int]:
        """What the engine serves at once: rows of a batch and tokens of KV cache."""
        kv_tokens = self.pool.usable_blocks * self.pool.block_size if self.pool is not None else self.cache.num_slots
        return {
            "max_batch_size": self.max_batch_size if self.batched else 1,
            "kv_cache_tokens": kv_tokens,
            "max_queue": self.scheduler.config.max_queue,
        }

    def warm_up(self, temperatures: tuple[float, ...] = (0.0, 1.0)) -> None:
        """Compile and capture the decode and verification graphs now rather than inside the first
        request (on CUDA that takes seconds to a minute; torch.compile's disk cache shortens later starts),
        with one request a prompt bucket so that every prefill graph exists too. On the CPU: a speculative
        engine's tier costs in every batch bucket (timing them inside the first requests' steps stalled a
        burst of 16 for seconds), on a thread that ends (cpu_threads)."""
        if self.device.type != "cuda":
            if self.scheduler.controller is not None:  # a batched speculative engine
                on_own_thread(self.scheduler.calibrate)
            return
        if self.batched:
            buckets, start = self.scheduler.batch.buckets, time.perf_counter()
            for i, rows in enumerate(buckets):
                # Compiling every bucket takes minutes with empty caches: say where it is.
                print(
                    f"warm-up: batch bucket {rows} ({i + 1} of {len(buckets)}), "
                    f"{time.perf_counter() - start:.0f} s so far",
                    file=sys.stderr,
                    flush=True,
                )
                if isinstance(self.scheduler.step, SpecStep):  # every tier's graphs, and its cost
                    self.scheduler.calibrate(rows, sampled=any(t > 0 for t in temperatures))
                    continue
                # The bucket's decode graph, greedy and sampled (by default).
                for temperature in temperatures:
                    # Prompts are prefilled one an iteration: each request outlives the prefills of the
                    # others, so that `rows` rows decode together at the end.
                    tokens = rows + WARMUP_NEW_TOKENS
                    params = SamplingParams(max_tokens=tokens, temperature=temperature, seed=0, end_id=-1)
                    streams = [self.stream([0], params) for _ in range(rows)]
                    for chunks in streams:
                        for _ in chunks:
                            pass
            for n in warm_up_prompt_lengths(self.limits):  # every prompt bucket's graph, each first-token mode
                for temperature in temperatures:
                    self.generate([0] * n, SamplingParams(max_tokens=1, temperature=temperature, seed=0, end_id=-1))
            return
        if self.graphs is None:
            return
        for n in warm_up_prompt_lengths(self.limits):
            self.generate([0] * n, SamplingParams(max_tokens=WARMUP_NEW_TOKENS, end_id=-1))

    # ------------------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        params.check()
        n = len(prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty; send at least one token of text")
        if n > self.limits.max_input_len:
            raise RequestError(
                f"the prompt has {n} tokens, over this engine's max_input_len {self.limits.max_input_len}"
            )
        if n + params.max_tokens > self.limits.max_seq_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds this engine's "
                f"max_seq_len {self.limits.max_seq_len}; lower max_tokens"
            )
        vocab = self.target.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        for chunk in self.stream(prompt_ids, params):
            if chunk.finished and chunk.result is not None:
                return chunk.result
        raise AssertionError("stream ended without a final chunk")

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """The request's chunks as the scheduler produces them; closing the stream (from any thread) cancels
        the request.
        RequestError for a request the engine refuses, EngineBusy when its queue is full (both before any
        chunk)."""
        self.validate(prompt_ids, params)
        return self.scheduler.submit(prompt_ids, params)

    def _serial(self, prompt_ids: list[int], params: SamplingParams) -> Generator[StreamChunk, None, None]:
        with torch.inference_mode():
            yield from self._decode(list(prompt_ids), params)

    def verify_external(self, prompt_ids: list[int], draft_ids: list[int]) -> list[int]:
        """Greedy check of draft tokens proposed outside the engine (TensorRT-LLM's draft_tokens_external):
        the accepted prefix of `draft_ids` plus the target's own next token.

        Each call is a fresh pass over prompt + drafts in its own KV cache, so it can run beside
        any other request; the caller (a BLS draft loop) sends the whole sequence every time.
        """
        self.validate(prompt_ids, SamplingParams(max_tokens=len(draft_ids) + 1))
        n = len(prompt_ids)
        tokens = torch.tensor(prompt_ids + draft_ids, device=self.device)
        with torch.inference_mode():
            cache = self.target.new_cache(tokens.shape[0])
            ctx = make_context(cache, self.target.rotary, 0, torch.arange(tokens.shape[0], device=self.device), None)
            hidden, _ = self.target(tokens[None], ctx)
            choice = self.target.logits(hidden[0, n - 1 :]).argmax(-1).tolist()  # after the prompt, after each draft
        accepted = 0
        while accepted < len(draft_ids) and draft_ids[accepted] == choice[accepted]:
            accepted += 1
        return draft_ids[:accepted] + [choice[accepted]]

    def stop_checker(self, params: SamplingParams) -> StopChecker:
        end_id = (
            self.tokenizer.eos_token_id if params.end_id is None else (None if params.end_id < 0 else params.end_id)
        )
        return StopChecker(params, end_id, self.tokenizer)

    def request_state(self, params: SamplingParams) -> tuple[torch.Generator, StopChecker]:
        """A request's own random generator (seeded when asked) and stop conditions."""
        generator = torch.Generator().manual_seed(params.seed if params.seed is not None else torch.seed())
        return generator, self.stop_checker(params)

    def result(self, prompt_ids: list[int], out: list[int], reason: str, stats: SpecStats) -> GenerationResult:
        return GenerationResult(prompt_ids, out, self.tokenizer.decode(out, skip_special_tokens=True), reason, stats)

    # ------------------------------------------------------------------------------------------
    def _decode(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        generator, stop = self.request_state(params)
        stats = SpecStats()
        out: list[int] = []

        prompt = torch.tensor(prompt_ids, device=self.device)
        target = self.prefill(prompt)
        root = choose(self.target.logits(target.hidden[-1:]), params, generator)
        self.proposer.start(prompt, target, root)
        length = len(prompt_ids)
        new = stop.take(out, root.tolist())
        ahead = self.run_ahead if params.greedy and self.proposer.runs_ahead else 1
        step = lambda root, at: StepInput(root, at, prompt_ids, out, params, generator)
        queued: _Steps | None = None  # steps on the device, not read yet

        while not stop.reason:
            yield StreamChunk(new, False)
            if ahead == 1:  # one step, its length a host int, read back at once
                group = self._queue(1, root, length, step)
            else:  # the length stays on the device and the group's steps queue up, read with one sync
                steps_left = math.ceil((params.max_tokens - len(out)) * QUEUE_SHARE / stats.acceptance_length)
                group = queued or self._queue(
                    max(1, self._group_size(ahead, length, steps_left)),
                    root,
                    torch.tensor(length, device=self.device),
                    step,
                )
                # The next group goes on the device before this one is read, so the device does not
                # wait while the host reads and emits. Its cache bound assumes this group's worst case.
                more = self._group_size(ahead, length + group.steps * self.proposer.max_nodes, steps_left - group.steps)
                queued = self._queue(more, group.root, group.length, step) if more > 0 else None
            hosts = group.accepted.read()
            root = group.root
            if ahead == 1:
                tree, acc, target = group.last
                self.proposer.update(tree, acc, hosts[0][-1], target, length)
            new = []
            for tree, host in zip(group.trees, hosts):
                num_accepted = host[-1]
                stats.record(tree.num_nodes - 1, tree.max_depth, num_accepted)
                length += num_accepted + 1
                new += stop.take(out, host[: num_accepted + 1])
                if stop.reason:  # the steps after it (and a queued group) are discarded: the request ends here
                    break

        yield StreamChunk(new, True, self.result(prompt_ids, out, stop.reason, stats))

    def _queue(
        self,
        steps: int,
        root: torch.Tensor,
        length: int | torch.Tensor,
        step: Callable[[torch.Tensor, int | torch.Tensor], StepInput],
    ) -> _Steps:
        """Queue `steps` speculative steps from `root` at `length`. With a device length each step's
        proposer update takes device values, so no step waits for the host."""
        trees, accepted = [], []
        for _ in range(steps):
            tree, acc, target = self._verify(step(root, length))
            trees.append(tree)
            accepted.append(torch.cat([acc.tokens, acc.num_accepted.view(1)]))
            if isinstance(length, torch.Tensor):
                self.proposer.update(tree, acc, acc.num_accepted, target, length)
                length = length + acc.num_accepted + 1
            root = acc.tokens.gather(0, acc.num_accepted.view(1))
        return _Steps(trees, self.readback.start(torch.stack(accepted)), root, length, (tree, acc, target))

    def _group_size(self, ahead: int, length: int, steps_left: int) -> int:
        """Steps that may be queued from `length` (at most; 0 or less when none may): at most the
        steps the request is expected to need, each at most max_nodes slots' worth, and none may
        outgrow the cache."""
        room = (self.cache.num_slots - length) // self.proposer.max_nodes - 1
        return min(ahead, steps_left, room)

    def _verify(self, step: StepInput) -> tuple[DraftTree, Acceptance, TargetPass]:
        """Propose, verify, accept, and compact the accepted path's KV."""
        length = step.length
        graphed = (
            step.params.greedy and self.graphs is not None and self.graphs.supports(self.proposer.max_nodes, length)
        )
        if graphed and self.proposer.drafts_from_buffers:  # the whole step in one replay
            assert self.graphs is not None
            drafter = cast(BufferDrafter, self.proposer)
            drafter.prepare(step)
            tree, hidden, captured, acc = self.graphs.run_greedy_draft(drafter.draft, length)
            return tree, acc, TargetPass(hidden, captured)
        tree = self.proposer.propose(step)
        if graphed and tree.num_nodes > 1:
            assert self.graphs is not None
            hidden, captured, acc = self.graphs.run_greedy_tree(tree, length)
            return tree, acc, TargetPass(hidden, captured)
        target = self.forward(tree.tokens, length, length + tree.depths, tree.mask if tree.num_nodes > 1 else None)
        acc = self._accept(tree, target.hidden, step.params, step.generator)
        if tree.num_nodes > 1:
            self.cache.move(length + acc.path, length + self.slot_offsets[: tree.max_depth + 1])
        return tree, acc, target

    def prefill(self, prompt: torch.Tensor, cache: KVCache | None = None) -> TargetPass:
        """The target over a prompt from an empty cache (row 0 unless `cache` is another row): a
        graph replay when row 0's graphs have a bucket for it, else eager."""
        cache = self.cache if cache is None else cache
        if cache is self.cache and self.graphs is not None:
            replayed = self.graphs.prefill(prompt)
            if replayed is not None:
                return TargetPass(*replayed)
        return self.forward(prompt, 0, torch.arange(prompt.shape[0], device=self.device), None, cache)

    def forward(
        self,
        tokens: torch.Tensor,
        prefix_len: int | torch.Tensor,
        positions: torch.Tensor,
        tree_mask: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> TargetPass:
        """The target over T new tokens of one sequence (row 0 unless `cache` is another row). A
        device prefix_len (a loop running ahead of the host) reads every slot through a mask."""
        cache = self.cache if cache is None else cache
        if cache is self.cache and self.graphs is not None and self.graphs.supports(tokens.shape[0], prefix_len):
            return TargetPass(*self.graphs.run(tokens, prefix_len, positions, tree_mask))
        if isinstance(prefix_len, torch.Tensor):
            t = tokens.shape[0]
            rows = tree_mask if tree_mask is not None else torch.ones(1, 1, dtype=torch.bool, device=self.device)
            ctx = full_slot_context(
                cache,
                self.target.rotary,
                prefix_len,
                positions,
                prefix_len + self.slot_offsets[:t],
                rows,
                torch.arange(cache.num_slots, device=self.device),
            )
        else:
            ctx = make_context(cache, self.target.rotary, prefix_len, positions, tree_mask)
        hidden, captured = self.target(tokens[None], ctx, self.proposer.capture_layers)
        return TargetPass(hidden[0], [c[0] for c in captured])

    def _accept(
        self, tree: DraftTree, hidden: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> Acceptance:
        if params.greedy:  # the argmax never needs the float logits in memory
            return accept_greedy(tree, self.greedy(hidden))
        logits = self.target.logits(hidden)
        if self.spec.acceptance == "typical":
            return accept_typical(tree, logits, params, self.spec.typical_acceptance, generator)
        return accept_sampling(tree, logits, params, generator)
