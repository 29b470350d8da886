"""Request: validation names the field; equality, hashing and JSON round trip."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from dlo_fn.models import CONFIGS, Request

TINY = CONFIGS["tiny"]
GOOD = Request(prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=4)


def test_good_request_validates_and_chains():
    assert GOOD.validate(TINY) is GOOD
    assert Request(prompt="x").validate(CONFIGS["cosmos3-nano"])  # defaults: the published Nano workload


@pytest.mark.parametrize(
    "change, field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x" * 64}, "prompt"),  # tiny reads 63 bytes
        ({"negative_prompt": "y" * 64}, "negative_prompt"),
        ({"negative_prompt": None}, "negative_prompt"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"num_inference_steps": -3}, "num_inference_steps"),
        ({"height": 24}, "height"),
        ({"width": 0}, "width"),
        ({"num_frames": 6}, "num_frames"),
        ({"fps": 0}, "fps"),
        ({"guidance_scale": 0.5}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"shift": 0.0}, "shift"),
        ({"sampler": "ddim"}, "sampler"),
        ({"outputs_per_prompt": 0}, "outputs_per_prompt"),
        ({"quality": ""}, "quality"),
        ({"lora": ""}, "lora"),
        ({"lora_scale": float("inf")}, "lora_scale"),
        ({"extra_args": {"nested": {"a": 1}}}, "extra_args"),
    ],
)
def test_validate_names_the_field(change, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        dataclasses.replace(GOOD, **change).validate(TINY)


def test_shape_is_checked_only_with_a_config():
    odd = dataclasses.replace(GOOD, height=24)
    assert odd.validate() is odd
    with pytest.raises(ValueError, match="height"):
        odd.validate(TINY)


def test_equality_hash_and_read_only_extra_args():
    a = dataclasses.replace(GOOD, extra_args={"b": [1, 2], "a": "x"})
    b = dataclasses.replace(GOOD, extra_args={"a": "x", "b": (1, 2)})
    assert a == b and hash(a) == hash(b) and len({a, b, GOOD}) == 2
    assert a.extra_args["b"] == (1, 2)
    with pytest.raises(TypeError):
        a.extra_args["c"] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.seed = 3


def test_pickles_for_torch_distributed_object_collectives():
    req = dataclasses.replace(GOOD, extra_args={"k": [1, 2]})
    again = pickle.loads(pickle.dumps(req))
    assert again == req and hash(again) == hash(req)
    with pytest.raises(TypeError):
        again.extra_args.update(k=3)


def test_json_round_trip():
    req = dataclasses.replace(GOOD, negative_prompt="blur", extra_args={"k": [1, 2], "flag": True})
    again = Request.from_dict(json.loads(json.dumps(req.to_dict())))
    assert again == req
    with pytest.raises(ValueError, match="unknown field"):
        Request.from_dict({**req.to_dict(), "steps": 3})


def test_cfg_and_batch_size():
    assert GOOD.cfg and GOOD.batch_size == 2
    assert dataclasses.replace(GOOD, guidance_scale=1.0, outputs_per_prompt=3).batch_size == 3
