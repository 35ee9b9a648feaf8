"""`VLLMClient`: the `InferenceEngine` of an orchestrator whose rollouts run on the job's vLLM servers.

Completions go through the `openai` package's async client (many requests in flight, bounded by
`max_concurrency`; each request's timeout and retries with backoff are the client's), prompts as
token ids, each request asking for the sampled tokens' ids and log-probabilities. A request
carries up to `prompts_per_request` prompts, a group of equal prompts as one prompt with `n`
samples: per-request overhead, not the model, dominates small models' rollouts. Adapters are
loaded with vLLM's `/v1/load_lora_adapter` (`load_inplace`: a new version under the same name)
into every replica.

Faults, and what the client does about them:
- a server that does not answer (killed, restarting, hung past the request timeout and the
  retries): wait for the endpoint folder to name servers that answer, load this client's
  adapters into them again, and redo the whole call with the same seeds; after
  `reconnect_timeout_s` without a server, `InferenceUnavailableError`;
- the server does not know the adapter (it restarted behind the same address): load, redo;
- the server refuses an adapter (HTTP 4xx/5xx on load): `AdapterRefusedError` with its reason;
- the server refuses a request (HTTP 400): `InferenceError`, not retried.
Because a call is redone whole, a step's rollouts are never half old and half new.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from rlplex.aio import close_loop
from rlplex.errors import AdapterRefusedError, InferenceError, InferenceUnavailableError
from rlplex.inference.config import EngineSettings
from rlplex.inference.engine import Completion, SamplingParams
from rlplex.inference.vllm_server import Endpoint, read_api_key, read_endpoint

_SERVER_TROUBLE = (openai.APIConnectionError, openai.APITimeoutError, openai.InternalServerError, httpx.TransportError)


class _ServerGone(Exception):
    """Internal: the servers did not answer; wait for the endpoint and redo the call."""


class VLLMClient:
    def __init__(self, endpoint: Path | Endpoint, api_key: str, settings: EngineSettings) -> None:
        self._source = endpoint
        self.api_key, self.settings = api_key, settings
        self._loop = asyncio.new_event_loop()
        self._endpoint: Endpoint | None = None
        self._clients: dict[str, openai.AsyncOpenAI] = {}
        self._http: httpx.AsyncClient | None = None
        self._wanted: dict[str, Path] = {}  # adapters this client serves: loaded again after a restart
        self._loaded: dict[str, tuple[int, Path]] = {}  # name -> (server incarnation, folder) now loaded
        self.reconnects = 0
        self.last_load_s = 0.0

    @classmethod
    def for_settings(cls, settings: EngineSettings) -> VLLMClient:
        if settings.endpoint_dir is None:
            raise InferenceError("engine = 'vllm' needs endpoint_dir (the folder with endpoint.json and api_key)")
        folder = Path(settings.endpoint_dir)
        return cls(folder, read_api_key(folder), settings)

    # -- InferenceEngine ----------------------------------------------------------------------
    def load_adapter(self, name: str, path: Path) -> float:
        """Load into every replica; the seconds returned are the load calls' (not a wait for a server)."""
        self._wanted[name] = Path(path)
        self.last_load_s = 0.0
        self._run(self._with_reconnect(lambda endpoint: self._ensure_adapter(name, endpoint)))
        return self.last_load_s

    def unload_adapter(self, name: str) -> None:
        self._wanted.pop(name, None)
        self._loaded.pop(name, None)
        endpoint = self._endpoint or self._read_endpoint()
        if endpoint is None:
            return  # no server: nothing is loaded
        try:
            self._run(self._post_all(endpoint, "unload_lora_adapter", {"lora_name": name}, missing_ok=True))
        except (_ServerGone, AdapterRefusedError):
            pass  # a restarted server has no adapters; one that refuses the unload will evict by LRU

    def generate(self, adapter: str, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        if adapter not in self._wanted:
            raise InferenceError(f"adapter {adapter!r} was never loaded through this client")

        async def attempt(endpoint: Endpoint) -> list[Completion]:
            await self._ensure_adapter(adapter, endpoint)
            return await self._complete_all(endpoint, adapter, prompts, params)

        result: list[Completion] = self._run(self._with_reconnect(attempt))
        return result

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._close_clients())
        close_loop(self._loop)

    # -- internals -------------------------------------------------------------------------------
    def _run(self, coroutine: Any) -> Any:
        return self._loop.run_until_complete(coroutine)

    def _read_endpoint(self) -> Endpoint | None:
        return self._source if isinstance(self._source, Endpoint) else read_endpoint(self._source)

    async def _close_clients(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _with_reconnect(self, call: Any) -> Any:
        deadline = time.monotonic() + self.settings.reconnect_timeout_s
        backoff = 0.5
        while True:
            endpoint = await self._wait_endpoint(deadline)
            try:
                return await call(endpoint)
            except _ServerGone as gone:
                self.reconnects += 1
                self._endpoint = None  # read the folder again: the servers may have moved
                self._loaded.clear()  # and a restarted server has none of our adapters
                if time.monotonic() > deadline:
                    raise InferenceUnavailableError(
                        f"no inference server answered for {self.settings.reconnect_timeout_s:g} s "
                        f"(last error: {gone}); endpoint {self._source}"
                    ) from None
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _wait_endpoint(self, deadline: float) -> Endpoint:
        while True:
            endpoint = self._endpoint or self._read_endpoint()
            if endpoint is not None:
                if self._endpoint != endpoint:
                    await self._close_clients()
                    self._loaded = {k: v for k, v in self._loaded.items() if v[0] == endpoint.incarnation}
                self._endpoint = endpoint
                return endpoint
            if time.monotonic() > deadline:
                raise InferenceUnavailableError(
                    f"{self._source}: no inference endpoint after {self.settings.reconnect_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)

    def _client(self, url: str) -> openai.AsyncOpenAI:
        if url not in self._clients:
            self._clients[url] = openai.AsyncOpenAI(
                base_url=f"{url}/v1",
                api_key=self.api_key,
                timeout=self.settings.request_timeout_s,
                max_retries=self.settings.max_retries,
            )
        return self._clients[url]

    async def _ensure_adapter(self, name: str, endpoint: Endpoint) -> None:
        path = self._wanted[name]
        if self._loaded.get(name) == (endpoint.incarnation, path):
            return
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": True}
        started = time.perf_counter()
        await self._post_all(endpoint, "load_lora_adapter", body)
        self.last_load_s = time.perf_counter() - started
        self._loaded[name] = (endpoint.incarnation, path)

    async def _post_all(self, endpoint: Endpoint, route: str, body: dict[str, Any], missing_ok: bool = False) -> None:
        if self._http is None:
            self._http = httpx.AsyncClient(
                headers={"Authorization": f"Bearer {self.api_key}"}, timeout=self.settings.request_timeout_s
            )
        for url in endpoint.urls:
            try:
                response = await self._http.post(f"{url}/v1/{route}", json=body)
            except httpx.TransportError as error:
                raise _ServerGone(f"{url}: {type(error).__name__}: {error}") from None
            if response.status_code == 404 and missing_ok:
                continue
            if response.status_code >= 400:
                raise AdapterRefusedError(
                    f"{url}/v1/{route} {body.get('lora_path', body['lora_name'])}: HTTP {response.status_code}: "
                    f"{response.text[:500]}"
                )

    async def _complete_all(
        self, endpoint: Endpoint, adapter: str, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """One request per chunk of up to `prompts_per_request` prompts; a run of identical
        prompts (a GRPO group) is one prompt with `n` samples, so the server sees each prompt
        once and prefills it once. Requests are spread over the replicas and run concurrently."""
        limit = asyncio.Semaphore(self.settings.max_concurrency)
        requests = _requests_of(prompts, self.settings.prompts_per_request)

        async def one(number: int, first_row: int, chunk: list[list[int]], n: int) -> list[Completion]:
            async with limit:
                url = endpoint.urls[number % len(endpoint.urls)]
                return await self._complete(url, adapter, chunk, n, params, params.seed + first_row)

        calls = [one(number, *request) for number, request in enumerate(requests)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return [completion for result in results if isinstance(result, list) for completion in result]

    async def _complete(
        self, url: str, adapter: str, prompts: list[list[int]], n: int, params: SamplingParams, seed: int
    ) -> list[Completion]:
        try:
            response = await self._client(url).completions.create(
                model=adapter,
                prompt=prompts,
                n=n,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                logprobs=0,
                seed=seed,
                extra_body={
                    "return_token_ids": True,
                    "stop_token_ids": [] if params.ignore_eos else list(params.stop_ids),
                    "ignore_eos": params.ignore_eos,
                },
            )
        except openai.NotFoundError:
            self._loaded.pop(adapter, None)  # the server forgot it (restarted): load it again, redo
            raise _ServerGone(f"{url}: adapter {adapter!r} is not loaded") from None
        except _SERVER_TROUBLE as error:
            raise _ServerGone(f"{url}: {type(error).__name__}: {error}") from None
        except openai.APIStatusError as error:
            raise InferenceError(
                f"{url}: completion request refused: HTTP {error.status_code}: {error.message}"
            ) from None
        return _completions_of(url, response, len(prompts) * n)


def _requests_of(prompts: Sequence[Sequence[int]], per_request: int) -> list[tuple[int, list[list[int]], int]]:
    """(first row, prompts, n) per request: consecutive equal prompts become one prompt with n
    samples; chunks hold runs of one length, in row order, so the answers concatenate back."""
    runs: list[tuple[int, list[int], int]] = []  # (first row, prompt, count)
    for row, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if runs and runs[-1][1] == ids:
            first, _, count = runs[-1]
            runs[-1] = (first, ids, count + 1)
        else:
            runs.append((row, ids, 1))
    requests: list[tuple[int, list[list[int]], int]] = []
    for first, ids, count in runs:
        last = requests[-1] if requests else None
        if last is not None and last[2] == count and len(last[1]) < per_request:
            last[1].append(ids)
        else:
            requests.append((first, [ids], count))
    return requests


def _completions_of(url: str, response: Any, expected: int) -> list[Completion]:
    """The choices in request order (prompt-major, then sample): vLLM numbers them so."""
    try:
        choices = sorted(response.choices, key=lambda choice: int(choice.index))
        completions = []
        for choice in choices:
            token_ids = [int(t) for t in (choice.model_extra or {})["token_ids"]]
            logprobs = [float(p) for p in choice.logprobs.token_logprobs]
            completions.append(Completion(token_ids, logprobs, str(choice.finish_reason)))
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as error:
        raise InferenceError(f"{url}: malformed completion response ({type(error).__name__}: {error})") from None
    if len(completions) != expected:
        raise InferenceError(f"{url}: {len(completions)} completions in the response, {expected} asked for")
    return completions
