"""Run in vLLM's venv (not collected by pytest): one process, many vLLM engines, one at a time.

tests/integrations/test_vllm_plugin.py starts it (``VllmSession``) and sends it one JSON request
a line on stdin; each builds ``vllm.LLM`` with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller; a tensor parallel engine still spawns
its workers, which inherit the request's environment), generates greedy tokens of token-id
prompts (no tokenizer), lets the engine go and answers one JSON line on the protocol pipe:
``{"tokens": ..., "load_s": ...}`` or ``{"error": "<type>: <message>"}``. A request with
``code`` instead runs that Python (a check that needs vLLM but no engine) and answers
``{"ok": true}`` or the error. Everything printed
during a request (both file descriptors, C++ and the workers too) goes to that request's ``log``
file, which the tests read for the lines a user would see. Importing vLLM once (10-30 s on the
2-core machine these tests were timed on) and not spawning an engine-core process per engine
(another 20-30 s) is what this saves; the OpenAI server test runs `vllm serve` as a user does."""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback


def run(args: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(skip_tokenizer_init=True, max_model_len=64, dtype=args.get("dtype", "bfloat16"),
              enforce_eager=args.get("eager", False), tensor_parallel_size=args.get("tp", 1), max_num_seqs=4, seed=0)  # fmt: skip
    if args.get("quant"):
        kw["quantization"] = args["quant"]
    if args.get("cc"):
        kw["compilation_config"] = args["cc"]
    t0 = time.time()
    try:
        llm = LLM(args["model"], **kw)
    except Exception as e:  # the line a user sees, for the error tests
        msg = f"{type(e).__name__}: {e}"
        print("ERROR " + json.dumps(msg), flush=True)
        traceback.print_exc()
        return {"error": msg}
    t1 = time.time()
    sp = SamplingParams(temperature=0.0, max_tokens=args["n"], detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]], sp)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "load_s": t1 - t0}
    del llm, outs  # the engine (in this process, when serving) goes with it
    gc.collect()
    return res


def serve() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # between requests, everything printed goes where stderr goes (the session's log)
    base_out, base_err = os.dup(1), os.dup(2)
    import vllm  # noqa: F401  (once, before the first request)
    from vllm.distributed import cleanup_dist_env_and_memory

    proto.write("READY\n")
    for line in sys.stdin:
        req = json.loads(line)
        saved = {k: os.environ.get(k) for k in req.get("env", {})}
        with open(req["log"], "w") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                os.environ.update(req.get("env", {}))
                try:
                    if "code" in req:  # a check that needs vLLM but no engine: its output is the log
                        exec(compile(req["code"], "<request>", "exec"), {"__name__": "__request__"})
                        res = {"ok": True}
                    else:
                        res = run(req)
                except BaseException as e:  # generate failed after the engine was built
                    traceback.print_exc()
                    res = {"error": f"{type(e).__name__}: {e}"}
                finally:
                    cleanup_dist_env_and_memory()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(base_out, 1)
                os.dup2(base_err, 2)
        proto.write(json.dumps(res) + "\n")


if __name__ == "__main__":  # the workers of a tensor parallel engine import this module again
    serve()
