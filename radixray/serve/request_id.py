"""Which id an HTTP generation request runs under, for ``POST /abort_request``.

Every generation request (OpenAI and native) has one *base* id: the body's ``rid``
(SGLang's field; the OpenAI routes accept it as an extension), else the ``X-Request-Id``
header (behind Ray Serve's proxy always present: the client's, or one the proxy made up,
which is also the id in Serve's logs), else a fresh one. The OpenAI ``id`` embeds it
(``cmpl-<rid>``, ``chatcmpl-<rid>``), the native ``meta_info.id`` is it (or a choice's
id), and unless the body gave it, the response's ``X-Request-Id`` header is it, streaming
or not (Serve's proxy puts its own id in that header, so with a body ``rid`` the header
holds Serve's id, not the rid).

A request that starts several generations (a batch of prompts, ``n`` > 1) runs them as
``<rid>_0``, ``<rid>_1``, ... (engine/request_ids.py), so aborting the base id aborts all
of them. A native batch may instead give one id per prompt (a list), used as they are.
"""

from __future__ import annotations

from radixray.engine.request_ids import MAX_RID_LENGTH, choice_rids, new_rid
from radixray.serve.api_error import ApiError

REQUEST_ID_HEADER = "X-Request-Id"


def base_rid(body_rid: str | None, header_rid: str | None) -> str:
    """The request's base id (see the module docstring); the body's ``rid`` wins over the
    header, which Ray Serve's proxy sets on every request it forwards (to the client's
    ``X-Request-Id`` when one was sent, else to a fresh id of its own). 400 naming ``rid``
    when the header's id is empty or too long."""
    if body_rid is not None:
        return body_rid
    if header_rid is not None:
        header_rid = header_rid.strip()
        if not header_rid or len(header_rid) > MAX_RID_LENGTH:
            raise ApiError(400, f"the {REQUEST_ID_HEADER} header must hold 1 to "
                           f"{MAX_RID_LENGTH} characters", param="rid")
        return header_rid
    return new_rid()


def generation_rids(rid: str | list[str], n: int) -> list[str]:
    """The ids of a request's ``n`` generations: derived from a base id, or one given per
    generation (a list of ``n`` distinct ids); 400 naming ``rid`` otherwise."""
    if isinstance(rid, str):
        return choice_rids(rid, n)
    if len(rid) != n or len(set(rid)) != n or not all(rid):
        raise ApiError(400, f"rid: a list needs {n} distinct non-empty ids, one per prompt "
                       f"(or give one id for the whole request)", param="rid")
    return list(rid)
