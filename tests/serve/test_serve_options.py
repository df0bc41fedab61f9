"""ServeOptions: serve's flags mapped once, for the local server and the Ray replicas alike."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import pytest

from specdec_rt import Engine
from specdec_rt.cli import _model_args
from specdec_rt.errors import InvalidInputError
from specdec_rt.serve.options import ServeOptions

pytest.importorskip("starlette")
from specdec_rt.serve.app import create_app  # noqa: E402
from specdec_rt.serve.cli import _access, _options, add_serve_parser  # noqa: E402
from specdec_rt.serve.ray import RayOptions  # noqa: E402


def test_the_options_are_what_the_engine_and_the_app_take():
    opts = ServeOptions(model="m", threads=3)
    load = inspect.signature(Engine.load).parameters
    app = inspect.signature(create_app).parameters
    assert set(opts.engine_options()) <= set(load) and set(opts.app_options()) <= set(app)
    assert opts.engine_options()["threads"] == 3 and opts.engine_options(threads=2)["threads"] == 2
    used = set(opts.engine_options()) | set(opts.app_options()) | {"model"}
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
    assert opts.app_options()["max_prompt_logprob_work"] == 1 << 20  # the default
    for flag, want in (("0", None), ("5000", 5000)):
        args = parser.parse_args(["serve", "--model", "m", "--max-prompt-logprob-work", flag])
        assert ServeOptions(**_options(args, _access(args), tmp_path)).app_options()["max_prompt_logprob_work"] == want
