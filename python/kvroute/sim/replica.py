"""One simulated vLLM replica: engine model, step loop, event publisher, faults and counters.

The HTTP layer (:mod:`kvroute.sim.server`) reads and drives a :class:`Replica`; the tokenizer and
chat template are shared by all replicas of a process (they are stateless).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import zmq.asyncio

from kvroute._native import SimEngine
from kvroute.chat_template import ChatTemplate, ChatTemplateError
from kvroute.sim.config import SimConfig
from kvroute.sim.engine_loop import EngineLoop
from kvroute.sim.events import EventPublisher
from kvroute.sim.faults import FaultSpec, FaultState
from kvroute.sim.metrics import ReplicaStats, render
from kvroute.sim.protocol import ApiError, ChatRequest, bad_request
from kvroute.tokenization import Tokenizer
from kvroute.vllm.receiver import TokenReceiver


class Replica:
    """Replica ``index`` of a simulator process. Create inside the running event loop."""

    def __init__(
        self,
        index: int,
        config: SimConfig,
        *,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        zmq_ctx: zmq.asyncio.Context,
    ) -> None:
        self.index = index
        self.config = config
        self.tokenizer = tokenizer
        self.template = template
        e = config.engine
        self.vocab_size = e.vocab_size or tokenizer.vocab_size
        self.engine = SimEngine(
            preset=e.preset,
            block_size=e.block_size,
            num_gpu_blocks=e.num_gpu_blocks,
            num_cpu_blocks=e.num_cpu_blocks,
            max_num_seqs=e.max_num_seqs,
            max_num_batched_tokens=e.max_num_batched_tokens,
            hash_algo=e.hash_algo,
            hash_seed=e.hash_seed,
            seed=e.seed + index,
            # vLLM accepts any id of the tokenizer (special tokens included) in a prompt.
            vocab_size=self.vocab_size,
        )
        self.stats = ReplicaStats()
        self.faults = FaultState(seed=config.fault_seed * 1000 + index)
        self.publisher: EventPublisher | None = None
        endpoint = config.events_endpoint(index)
        if endpoint is not None:
            self.publisher = EventPublisher(
                zmq_ctx,
                endpoint,
                replay_endpoint=config.replay_endpoint(index),
                topic=config.topic,
                buffer_steps=config.buffer_steps,
                hwm=config.hwm,
            )
        self.loop = EngineLoop(
            self.engine,
            publisher=self.publisher,
            faults=self.faults,
            stats=self.stats,
            time_scale=config.time_scale,
            legacy_events=config.legacy_events,
        )
        self.eos_token_id = tokenizer.token_id(template.eos_token)
        engine_config = self.engine.config()
        self.block_size = int(self.engine.metrics()["block_size"])
        self.engine_config: dict[str, object] = dict(engine_config)
        self._timers: list[asyncio.TimerHandle] = []
        self.handoff: TokenReceiver | None = None
        """The token-handoff receiver of :mod:`kvroute.vllm` (None when ``config.handoff`` is off)."""
        if config.handoff:
            self.handoff = TokenReceiver(config.handoff_settings(), zmq_ctx=zmq_ctx)

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self.loop.start()
        for spec in self.config.faults:
            if spec.replica is None or spec.replica == self.index:
                self.schedule(spec)

    async def aclose(self) -> None:
        for timer in self._timers:
            timer.cancel()
        if self.handoff is not None:
            await self.handoff.aclose()
        await self.loop.aclose()
        if self.publisher is not None:
            await self.publisher.aclose()

    # -- prompts --------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model:
            raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    async def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Tokenizes a prompt (off the loop when long) and counts the work."""
        ids = await self.tokenizer.encode_async(text, add_special_tokens=add_special_tokens)
        self.stats.tokenized_requests += 1
        self.stats.tokenized_tokens += len(ids)
        return ids

    async def chat_prompt(self, req: ChatRequest) -> list[int]:
        """The prompt ids of a chat request: vLLM's reused ids, or template + tokenizer."""
        if req.reused_prompt_token_ids is not None:
            self.stats.reused_prompt_requests += 1
            return list(req.reused_prompt_token_ids)
        try:
            text = self.template.render(
                list(req.messages), tools=req.tools, add_generation_prompt=req.add_generation_prompt
            )
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        return await self.encode_text(text, add_special_tokens=req.add_special_tokens)

    def check_prompt(self, ids: Sequence[int], max_tokens: int | None) -> int:
        """vLLM's length and vocabulary checks; returns the max_tokens to generate."""
        limit = self.config.max_model_len
        n = len(ids)
        if n == 0:
            raise bad_request("The prompt cannot be empty.", "prompt")
        if n >= limit and max_tokens is None:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input messages.",
                "messages",
            )
        if max_tokens is None:
            max_tokens = min(limit - n, self.config.default_max_tokens)
        if n + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                "Please reduce the length of the messages or completion.",
                "max_tokens",
            )
        top = max(ids)
        if top >= self.vocab_size:
            raise bad_request(f"Token id {top} is out of vocabulary", "prompt")
        return max_tokens

    # -- health, metrics, faults ----------------------------------------------------------------

    def unavailable(self) -> bool:
        return self.faults.unavailable(asyncio.get_running_loop().time())

    def metrics_text(self) -> str:
        m = self.engine.metrics()
        cache_info = {
            "block_size": int(m["block_size"]),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_cpu_blocks": int(m["num_cpu_blocks"]),
            "num_gpu_blocks": int(m["num_gpu_blocks"]),
            "prefix_caching_hash_algo": self.config.engine.hash_algo,
        }
        handoff = self.handoff.store.stats.as_dict() if self.handoff is not None else None
        return render(
            model=self.config.model, engine=m, cache_info=cache_info, stats=self.stats, handoff=handoff
        )

    def apply_fault(self, kind: str, value: float | None) -> None:
        """Applies a fault now (see :mod:`kvroute.sim.faults`)."""
        spec = FaultSpec(kind, value)  # validates
        now = asyncio.get_running_loop().time()
        if spec.kind == "drop":
            self.faults.drop_fraction = float(value or 0.0)
        elif spec.kind == "restart":
            self.loop.restart()
        elif spec.kind == "crash":
            self.loop.crash()
            if value:
                self._timers.append(asyncio.get_running_loop().call_later(value, self.loop.restart))
        elif spec.kind == "stall":
            self.loop.stall(float(value or 0.0))
        elif spec.kind == "unavailable":
            self.faults.unavailable_until = now + float(value or 0.0)
        else:  # clear
            self.faults.clear()
            self.loop.poke()

    def schedule(self, spec: FaultSpec) -> None:
        loop = asyncio.get_running_loop()
        self._timers.append(loop.call_later(spec.at_s, self.apply_fault, spec.kind, spec.value))

    def fault_state(self) -> dict[str, Any]:
        state = self.faults.snapshot(asyncio.get_running_loop().time())
        if self.publisher is not None:
            state["next_seq"] = self.publisher.next_seq
        return state
