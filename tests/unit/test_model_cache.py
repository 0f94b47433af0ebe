"""The models a worker process holds loaded (kiln/model_cache.py): one load per model,
least recently used evicted within the memory budget and the count, a model in use never
evicted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kiln.config import Settings
from kiln.model_cache import DEFAULT_MAX_MODELS, ModelCache


class Ctx:
    """What the cache needs of a worker's Context: the loading_model stage."""

    def __init__(self) -> None:
        self.stages: list[str] = []

    @contextlib.asynccontextmanager
    async def loading_model(self, name: str) -> AsyncIterator[None]:
        self.stages.append(name)
        yield


def loader(name: str, calls: list[str]) -> Callable[[], Awaitable[str]]:
    async def load() -> str:
        calls.append(name)
        await asyncio.sleep(0.01)
        return f"weights of {name}"

    return load


async def test_a_model_loads_once_however_many_ask_at_once() -> None:
    cache: ModelCache[str] = ModelCache(None)
    ctx, calls = Ctx(), []

    async def use() -> str:
        async with cache.use(ctx, "a", loader("a", calls), size_gb=1) as model:  # type: ignore[arg-type]
            return model

    assert await asyncio.gather(use(), use(), use()) == ["weights of a"] * 3
    assert calls == ["a"] and ctx.stages == ["a"]
    assert cache.loaded_models() == ["a"]


async def test_the_least_recently_used_idle_model_makes_room() -> None:
    unloaded: list[str] = []
    cache: ModelCache[str] = ModelCache(5, unload=lambda name, _: unloaded.append(name))
    ctx, calls = Ctx(), []
    for name in ["a", "b", "a", "c"]:  # a used again: b is the least recently used
        async with cache.use(ctx, name, loader(name, calls), size_gb=2):  # type: ignore[arg-type]
            pass
    assert calls == ["a", "b", "c"]
    assert unloaded == ["b"] and cache.evictions == 1
    assert cache.loaded_models() == ["a", "c"]  # least recently used first
    assert cache.used_gb == 4


async def test_a_model_in_use_is_kept_and_the_load_waits_for_room() -> None:
    cache: ModelCache[str] = ModelCache(3)
    ctx, calls = Ctx(), []
    order: list[str] = []
    release = asyncio.Event()

    async def hold_a() -> None:
        async with cache.use(ctx, "a", loader("a", calls), size_gb=2):  # type: ignore[arg-type]
            order.append("a in use")
            await release.wait()
        order.append("a released")

    async def want_b() -> None:
        async with cache.use(ctx, "b", loader("b", calls), size_gb=2):  # type: ignore[arg-type]
            order.append("b in use")

    holder = asyncio.create_task(hold_a())
    while "a in use" not in order:
        await asyncio.sleep(0)
    wanting = asyncio.create_task(want_b())
    await asyncio.sleep(0.05)
    # b does not fit beside a, which is in use: b waits, a stays
    assert order == ["a in use"] and calls == ["a"]
    release.set()
    await asyncio.gather(holder, wanting)
    assert order == ["a in use", "a released", "b in use"]
    assert cache.loaded_models() == ["b"]


async def test_a_failed_load_holds_nothing() -> None:
    cache: ModelCache[str] = ModelCache(None)

    async def broken() -> str:
        raise OSError("checkpoint damaged")

    with contextlib.suppress(OSError):
        async with cache.use(Ctx(), "x", broken, size_gb=1):  # type: ignore[arg-type]
            pass
    assert cache.loaded_models() == []


async def test_without_a_memory_limit_the_cache_holds_at_most_its_count() -> None:
    # Given a cache with no memory limit and a bound of three models
    unloaded: list[str] = []
    cache: ModelCache[str] = ModelCache(None, lambda name, _: unloaded.append(name), max_models=3)
    ctx, calls = Ctx(), []
    # When tasks bring ten model names, one after the other
    names = [f"m{n}" for n in range(10)]
    for name in names:
        async with cache.use(ctx, name, loader(name, calls), size_gb=1):  # type: ignore[arg-type]
            assert len(cache.loaded_models()) <= 3
    # Then it holds the last three, having unloaded the others least recently used first
    assert calls == names
    assert cache.loaded_models() == ["m7", "m8", "m9"]
    assert unloaded == names[:7] and cache.evictions == 7


async def test_the_default_count_bounds_a_cache_given_no_limit_at_all() -> None:
    cache: ModelCache[str] = ModelCache()
    ctx, calls = Ctx(), []
    for n in range(99):
        async with cache.use(ctx, f"m{n}", loader(f"m{n}", calls), size_gb=1):  # type: ignore[arg-type]
            pass
    assert len(cache.loaded_models()) == DEFAULT_MAX_MODELS
    assert Settings().max_loaded_models == DEFAULT_MAX_MODELS  # KILN_MAX_LOADED_MODELS's default


async def test_a_load_past_the_count_waits_for_a_model_in_use_and_counts_loads_under_way() -> None:
    # Given a cache of two models, one in use and one loading
    cache: ModelCache[str] = ModelCache(None, max_models=2)
    ctx, calls = Ctx(), []
    release, loading = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def slow() -> str:
        loading.set()
        await release.wait()
        return "weights of b"

    async def hold(name: str, load: Callable[[], Awaitable[str]]) -> None:
        async with cache.use(ctx, name, load, size_gb=1):  # type: ignore[arg-type]
            order.append(f"{name} in use")
            await release.wait()

    holders = [asyncio.create_task(hold("a", loader("a", calls)))]
    while "a in use" not in order:
        await asyncio.sleep(0)
    holders.append(asyncio.create_task(hold("b", slow)))
    await loading.wait()
    # When a third model is asked for
    third = asyncio.create_task(hold("c", loader("c", calls)))
    await asyncio.sleep(0.05)
    # Then it waits: a is in use and b's load holds the other place
    assert calls == ["a"] and cache.loaded_models() == ["a"]
    release.set()
    await asyncio.gather(*holders, third)
    assert calls == ["a", "c"] and len(cache.loaded_models()) == 2
    assert "c" in cache.loaded_models()


def test_a_cache_holds_at_least_one_model() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ModelCache(None, max_models=0)
