"""The HTTP routes: OpenAI (/v1/models, /v1/completions, /v1/chat/completions), vLLM's
/tokenize and /detokenize, and the operational /health, /version and /metrics.

Handlers stay thin: they parse (pydantic), authenticate the tenant (dependency), then call
the serving modules. /health answers 200 only while the engine loop is alive and stepping and
the server is not draining; it never waits on the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

import sits
from sits.obs.server_metrics import CONTENT_TYPE
from sits.server.context import ServerContext
from sits.server.errors import draining_error, error_response, unavailable, unsupported
from sits.server.protocol import ModelCard, ModelList
from sits.server.protocol_chat import ChatCompletionRequest
from sits.server.protocol_completion import CompletionRequest
from sits.server.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from sits.server.qos.admit import require_model_reader, require_tenant
from sits.server.serving_chat import create_chat_completion, template_messages
from sits.server.serving_common import check_prompt_ids, drop_double_bos, encode_prompt
from sits.server.serving_completion import create_completion

ops_router = APIRouter()
api_router = APIRouter(dependencies=[Depends(require_tenant)])
models_router = APIRouter(dependencies=[Depends(require_model_reader)])


def _ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


def _validate(model: type[BaseModel], data: Any) -> Any:
    """Validate a body by hand, raising FastAPI's error type (so it becomes our 400)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        raise RequestValidationError(errors) from exc


@ops_router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    """200 while the engine is alive and stepping; 503 when it is not, while draining, or
    while one step has run past its stall limit ("engine_stalled", with the reason: the
    engine lives on and the next probe after the step is 200; `sits.engine.step_watch`).
    HEAD answers the same status without a body (load balancers that probe with HEAD)."""
    lifecycle = _ctx(request).lifecycle
    if lifecycle.draining:
        return error_response(draining_error())
    if not lifecycle.healthy():
        return error_response(unavailable("The engine is not running.", "engine_dead"))
    stalled = lifecycle.stall_reason()
    if stalled is not None:
        return error_response(unavailable(f"The engine is stalled: {stalled}.", "engine_stalled"))
    return JSONResponse({"status": "ok"})


@ops_router.get("/version")
async def version() -> dict[str, str]:
    """sits' version, as vLLM's /version answers its own."""
    return {"version": sits.__version__}


@ops_router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus text exposition of this server's metrics."""
    return Response(_ctx(request).metrics.render(), media_type=CONTENT_TYPE)


def _model_card(ctx: ServerContext, name: str) -> ModelCard:
    settings = ctx.settings
    return ModelCard(
        id=name,
        root=settings.model_root,
        max_model_len=ctx.max_model_len,
        random_weights=settings.random_weights,
        description=settings.model_description,
    )


@models_router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    """The served model, one card per name it is served under (`--served-model-name a b`),
    with `random_weights` saying whether its weights are random."""
    ctx = _ctx(request)
    return ModelList(data=[_model_card(ctx, name) for name in ctx.model_names])


@models_router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """The served model's card, or 404."""
    ctx = _ctx(request)
    ctx.check_model(model_id)
    return _model_card(ctx, model_id)


@api_router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Response:
    """OpenAI completions (see `sits.server.serving_completion`)."""
    return await create_completion(req, request, _ctx(request))


@api_router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    """OpenAI chat completions (see `sits.server.serving_chat`)."""
    return await create_chat_completion(req, request, _ctx(request))


@api_router.post("/tokenize")
async def tokenize(request: Request, body: Annotated[dict[str, Any], Body()]) -> TokenizeResponse:
    """Token ids of a prompt, or of chat messages rendered through the chat template."""
    ctx = _ctx(request)
    tokenizer = ctx.tokenizer
    if "messages" in body:
        req = _validate(TokenizeChatRequest, body)
        ctx.check_model(req.model)
        if req.continue_final_message or req.add_special_tokens:
            bad = "continue_final_message" if req.continue_final_message else "add_special_tokens"
            raise unsupported(bad, f"{bad} is not supported.")
        ids = tokenizer.apply_chat_template(
            template_messages(req.messages), add_generation_prompt=req.add_generation_prompt
        )
        ids = drop_double_bos(list(ids), tokenizer.bos_token_id)
    else:
        req = _validate(TokenizeCompletionRequest, body)
        ctx.check_model(req.model)
        ids = encode_prompt(tokenizer, req.prompt, req.add_special_tokens)
    token_strs = [tokenizer.decode_token(t) for t in ids] if req.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=token_strs
    )


@api_router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """Text of token ids (special tokens skipped)."""
    ctx = _ctx(request)
    ctx.check_model(req.model)
    if req.tokens:
        check_prompt_ids(req.tokens, ctx.tokenizer, "tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens))
