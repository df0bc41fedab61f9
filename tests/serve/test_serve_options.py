"""ServeOptions: serve's flags mapped once, for the local server and the Ray replicas alike."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import anyio
import pytest

from specdec_rt import Engine
from specdec_rt.cli import _model_args
from specdec_rt.engine.served import DEFAULT_SLOTS, EventIterator, ServedEngine
from specdec_rt.errors import InvalidInputError
from specdec_rt.serve.options import AppConfig, ConnectionLimits, ServeOptions

pytest.importorskip("starlette")
from specdec_rt.serve.app import create_app  # noqa: E402
from specdec_rt.serve.cli import _access, _options, add_serve_parser  # noqa: E402
from specdec_rt.serve.ray import RayOptions  # noqa: E402


def test_the_options_are_what_the_engine_and_the_app_take():
    app_fields = {f.name for f in fields(AppConfig)}
    shared = {f.name for f in fields(ServeOptions)} & app_fields
    changed = dict(slots=3, max_queued=5, model_name="x", request_timeout=7.0, max_body_bytes=99,
                   default_max_tokens=11, api_keys=("sk-0123456789abcdef",), allowed_hosts=("a.example",),
                   allowed_origins=("https://a.example",), consumer_timeout=2.0, max_prompt_logprob_work=3)  # fmt: skip
    assert set(changed) == shared
    opts = ServeOptions(model="m", threads=3, **changed)
    load = inspect.signature(Engine.load).parameters
    assert set(opts.engine_options()) <= set(load)
    config = opts.app_config(drain_timeout=4.0)
    assert {n: getattr(config, n) for n in shared} == changed and config.drain_timeout == 4.0
    assert opts.engine_options()["threads"] == 3 and opts.engine_options(threads=2)["threads"] == 2
    used = set(opts.engine_options()) | shared | {"model"}
    assert {f.name for f in fields(ServeOptions)} == used  # every option reaches one of them


def test_ray_options_are_serve_options_plus_replicas():
    assert issubclass(RayOptions, ServeOptions)
    extra = {f.name for f in fields(RayOptions)} - {f.name for f in fields(ServeOptions)}
    assert extra == {"replicas", "cpus_per_replica", "autoscaling", "max_replicas_per_node"}
    with pytest.raises(InvalidInputError, match="slots"):
        RayOptions(model="m", slots=0)
    with pytest.raises(InvalidInputError, match="cpus_per_replica"):
        RayOptions(model="m", cpus_per_replica=0)


def test_the_flags_map_onto_the_options(tmp_path):
    parser = argparse.ArgumentParser()
    _model_args(add_serve_parser(parser.add_subparsers()))  # as specdec_rt.cli builds it
    args = parser.parse_args(
        ["serve", "--model", "m", "--slots", "3", "--max-queued", "5", "--draft", "none", "--threads", "2"]
        + ["--served-model-name", "x", "--consumer-timeout", "0", "--request-timeout", "7"]
    )
    opts = ServeOptions(**_options(args, _access(args), tmp_path))
    assert (opts.model, opts.slots, opts.max_queued, opts.draft, opts.threads) == (str(tmp_path), 3, 5, "none", 2)
    assert (opts.model_name, opts.consumer_timeout, opts.request_timeout) == ("x", None, 7)
    assert opts.app_config().max_prompt_logprob_work == 1 << 20  # the default
    for flag, want in (("0", None), ("5000", 5000)):
        args = parser.parse_args(["serve", "--model", "m", "--max-prompt-logprob-work", flag])
        assert ServeOptions(**_options(args, _access(args), tmp_path)).app_config().max_prompt_logprob_work == want


def _serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _model_args(add_serve_parser(parser.add_subparsers()))  # as specdec_rt.cli builds it
    return parser.parse_args(["serve", "--model", "m", *flags])


def test_the_flags_default_to_the_librarys_defaults(tmp_path):
    args = _serve_args()
    opts, defaults = ServeOptions(**_options(args, _access(args), tmp_path)), ServeOptions(model="m")
    for name in ("slots", "max_queued", "request_timeout", "max_body_bytes", "default_max_tokens",
                 "consumer_timeout", "max_prompt_logprob_work", "prefix_cache", "prefix_cache_bytes",
                 "shared_weights"):  # fmt: skip
        assert getattr(opts, name) == getattr(defaults, name), name
    assert opts.engine_options()["shared_weights"] is True
    args = _serve_args("--no-shared-weights")
    assert ServeOptions(**_options(args, _access(args), tmp_path)).engine_options()["shared_weights"] is False
    assert opts.slots == DEFAULT_SLOTS and opts.consumer_timeout == AppConfig().consumer_timeout
    limits = ConnectionLimits()
    for f in fields(ConnectionLimits):
        assert getattr(args, f.name) == getattr(limits, f.name), f.name
    assert (args.replicas, args.cpus_per_replica) == (RayOptions.replicas, RayOptions.cpus_per_replica)


class _Engine(ServedEngine):
    """A model-free engine that sets nothing but what the Protocol requires."""

    def stream(self, prompt, params=None, **overrides):
        raise AssertionError("not called")

    def token_bytes(self, token_id: int) -> bytes:
        return b""


def test_the_app_takes_the_engines_slots():
    """Was: an app given no ``slots`` took 4 whenever it could not read the engine's, for every
    loader (the engine's default is DEFAULT_SLOTS, 8): it admitted and queued too few."""
    assert create_app(_Engine()).state.serving.slots == DEFAULT_SLOTS  # the Protocol's default
    sized = _Engine()
    sized.slots = 3
    assert create_app(sized).state.serving.slots == 3
    assert create_app(sized, slots=2).state.serving.slots == 2  # the app's own limit wins

    async def loader() -> ServedEngine:
        return _Engine()

    app = create_app(loader, max_queued=0)

    async def check() -> None:
        async with app.router.lifespan_context(app):
            await app.state.serving.load()
            assert app.state.serving.state == "ready"
            assert app.state.serving.slots == DEFAULT_SLOTS
            app.state.serving.admit(DEFAULT_SLOTS)  # fits: its capacity is the engine's slots

    anyio.run(check)


def test_create_app_takes_a_config_and_its_fields_by_keyword():
    config = AppConfig(slots=2, max_queued=3, model_name="m")
    serving = create_app(_Engine(), config).state.serving
    assert (serving.slots, serving.max_queued, serving.model_name) == (2, 3, "m")
    serving = create_app(_Engine(), config, max_queued=5).state.serving  # a keyword over the config
    assert (serving.slots, serving.max_queued) == (2, 5)
    with pytest.raises(TypeError, match="max_queue"):
        create_app(_Engine(), max_queue=5)
    with pytest.raises(InvalidInputError, match="slots"):
        AppConfig(slots=0)


def test_create_app_refuses_an_engine_that_lacks_a_member():
    class Partial:
        def stream(self, prompt, params=None, **overrides):
            return EventIterator(_nothing())

    with pytest.raises(InvalidInputError, match="ServedEngine: it lacks .*token_bytes"):
        create_app(Partial())


async def _nothing():
    return
    yield
