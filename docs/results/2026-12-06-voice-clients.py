"""Issue #40's client measurements against a live `specedge serve` (SmolLM2 and the Qwen pair, 2026-12-06).

    specedge serve BUNDLE --model-name smollm2 --port 18431 --api-key sk-m --threads 2
    python docs/results/2026-12-06-voice-clients.py openai 4      # openai client: cold, prefilled, preemptive
    python docs/results/2026-12-06-voice-clients.py frameworks    # Pipecat and LiveKit, cold (`clients` extra)

openai: time to the first token cold, after a prefill on a partial transcript, and as LiveKit-style
preemptive attempts (3 cancelled 150-400 ms after sending, then the final), with cancel-to-free (the
close to the worker idle) and the final request's cached tokens. frameworks: cold time to the first
token through Pipecat's OpenAILLMService and LiveKit's openai.LLM, 3 calls each. Every call gets a
unique first line in its system prompt, so "cold" is cold.
"""
import asyncio, json, statistics as st, sys, time, uuid, random
import httpx
from openai import OpenAI, AsyncOpenAI
URL = "http://127.0.0.1:18431"; KEY = "sk-m"; H = {"Authorization": f"Bearer {KEY}"}
SYSTEM = ("You are Ava, the phone assistant of Green Leaf Bistro, 12 Harbour Street. Opening hours: Monday to "
          "Friday 11:30-22:00, Saturday 10:00-23:00, Sunday 10:00-21:00; the kitchen closes 45 minutes before. "
          "Reservations for up to 8 guests by phone; larger groups email events@greenleaf.example. Menu: seasonal "
          "salads, wood-fired pizza, fresh pasta, grilled fish, vegan curry, desserts. Gluten-free pasta and vegan "
          "cheese are available. Parking: the Harbour garage, 3 minutes away, validated for 2 hours. Keep every "
          "answer to one or two short spoken sentences; never use lists or markdown; confirm names, dates, times "
          "and party sizes back to the caller before booking; if unsure, offer to take a message for the manager. ") * 2
HIST = [{"role": "user", "content": "Hi, is this the Green Leaf Bistro?"},
        {"role": "assistant", "content": "Yes, this is Ava at Green Leaf Bistro. How can I help you today?"}]
FINAL = "Can I book a table for four people this Saturday at seven in the evening"
client = OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0)
def msgs(salt_text, user):  # a unique first line per run makes it cold
    return [{"role": "system", "content": salt_text + SYSTEM}] + HIST + [{"role": "user", "content": user}]
def ttft_openai(messages, cancel_after=None):
    t0 = time.perf_counter(); first = None; usage = None
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=48,
                                            stream=True, stream_options={"include_usage": True})
    for c in stream:
        if first is None and c.choices and c.choices[0].delta.content:
            first = time.perf_counter() - t0
        if cancel_after is not None and time.perf_counter() - t0 > cancel_after:
            stream.close(); tc = time.perf_counter()
            while httpx.get(URL + "/health").json()["busy"]: time.sleep(0.002)
            return first, time.perf_counter() - tc, None
        if c.usage: usage = c.usage
    return first, None, usage
def wait_idle():
    while True:
        s = httpx.get(URL + "/health").json()
        if not s["busy"] and not s["waiting_prefills"]: return
        time.sleep(0.01)


def openai_runs() -> None:
    R = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    res = {k: [] for k in ("cold", "prefilled", "preempt_final", "cancel_free", "preempt_reused", "prompt")}
    for i in range(R):
        tag = f"Call {uuid.uuid4().hex[:6]}. "
        f, _, u = ttft_openai(msgs(tag, FINAL)); res["cold"].append(f); res["prompt"].append(u.prompt_tokens)
        tag = f"Call {uuid.uuid4().hex[:6]}. "
        httpx.post(URL + "/v1/specedge/prefill", headers=H, json={"model": "smollm2", "messages": msgs(tag, FINAL[:40])}).raise_for_status()
        wait_idle(); f, _, u = ttft_openai(msgs(tag, FINAL)); res["prefilled"].append(f)
        tag = f"Call {uuid.uuid4().hex[:6]}. "; words = FINAL.split()
        for n in (4, 7, 10):  # LiveKit-style preemptive attempts on a growing transcript, each cancelled
            _, free, _ = ttft_openai(msgs(tag, " ".join(words[:n])), cancel_after=random.uniform(0.15, 0.4))
            if free is not None: res["cancel_free"].append(free)
        f, _, u = ttft_openai(msgs(tag, FINAL)); res["preempt_final"].append(f)
        res["preempt_reused"].append(u.prompt_tokens_details.cached_tokens)
    print(json.dumps({k: (round(st.median(v), 4), [round(x, 4) for x in v]) for k, v in res.items() if v}, indent=1))


async def frameworks() -> None:
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.services.openai.llm import OpenAILLMService
    from livekit.agents import llm as lkllm
    from livekit.plugins import openai as lk

    p = OpenAILLMService(base_url=URL + "/v1", api_key="sk-m", settings=OpenAILLMService.Settings(model="smollm2", temperature=0.0, max_completion_tokens=48))
    l = lk.LLM(model="smollm2", base_url=URL + "/v1", api_key="sk-m", temperature=0.0, max_completion_tokens=48)
    out = {"pipecat": [], "livekit": []}
    for i in range(3):
        tag = f"Call {uuid.uuid4().hex[:6]}. "
        ctx = LLMContext(messages=[{"role": "system", "content": tag + SYSTEM}] + HIST + [{"role": "user", "content": FINAL}])
        t0 = time.perf_counter()
        async for c in await p.get_chat_completions(ctx):
            if c.choices and c.choices[0].delta.content: out["pipecat"].append(time.perf_counter() - t0); break
        await asyncio.sleep(1.5)
        tag = f"Call {uuid.uuid4().hex[:6]}. "
        cc = lkllm.ChatContext.empty(); cc.add_message(role="system", content=tag + SYSTEM)
        for m in HIST: cc.add_message(role=m["role"], content=m["content"])
        cc.add_message(role="user", content=FINAL)
        t0 = time.perf_counter()
        async with l.chat(chat_ctx=cc) as s:
            async for c in s:
                if c.delta and c.delta.content: out["livekit"].append(time.perf_counter() - t0); break
        await asyncio.sleep(1.5)
    for k, v in out.items(): print(k, round(st.median(v), 3), [round(x, 3) for x in v])


if __name__ == "__main__":
    if sys.argv[1:2] == ["frameworks"]:
        asyncio.run(frameworks())
    else:
        openai_runs()
