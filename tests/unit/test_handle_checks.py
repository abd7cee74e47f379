"""The decode worker refuses a transfer handle that cannot fill the request's blocks."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from pdserve.errors import HandleError, LayoutMismatchError
from pdserve.protocol import GenerationRequest, KVLayout, SamplingParams, TransferHandle
from pdserve.workers.decode import check_handle

LAYOUT = KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4,
                  dtype="float32")  # fmt: skip
ENGINE = SimpleNamespace(layout=LAYOUT)


def _req(n_tokens: int = 10, **handle_kw) -> GenerationRequest:
    fields = dict(worker_id="p", epoch=1, request_id="r", block_ids=(0, 1, 2), num_tokens=n_tokens,
                  lease_deadline=time.time() + 30, layout=LAYOUT, backend="tcp",
                  transfer_endpoint="127.0.0.1:1")  # fmt: skip
    fields.update(handle_kw)
    return GenerationRequest(
        request_id="r",
        prompt_token_ids=tuple(range(10)),
        sampling=SamplingParams(),
        deadline=time.time() + 60,
        first_token=5,
        handle=TransferHandle(**fields),
    )


def test_matching_handle_is_accepted() -> None:
    req = _req()
    check_handle(req, req.handle, ENGINE)


def test_token_count_mismatch_is_refused() -> None:
    req = _req(n_tokens=9)
    with pytest.raises(HandleError, match="9 tokens"):
        check_handle(req, req.handle, ENGINE)


def test_wrong_number_of_blocks_is_refused() -> None:
    req = _req(block_ids=(0, 1))
    with pytest.raises(HandleError, match="need 3"):
        check_handle(req, req.handle, ENGINE)


def test_layout_mismatch_names_the_field() -> None:
    other = LAYOUT.model_copy(update={"tokens_per_block": 8})
    req = _req(layout=other, block_ids=(0, 1))
    with pytest.raises(LayoutMismatchError, match="tokens_per_block: 8 != 4"):
        check_handle(req, req.handle, ENGINE)


def test_expired_lease_is_refused() -> None:
    req = _req(lease_deadline=time.time() - 1)
    with pytest.raises(HandleError, match="expired"):
        check_handle(req, req.handle, ENGINE)


def test_handle_for_another_request_is_refused() -> None:
    req = _req(request_id="other")
    with pytest.raises(HandleError, match="other"):
        check_handle(req, req.handle, ENGINE)
