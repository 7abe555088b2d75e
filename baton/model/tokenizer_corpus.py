"""The small text the embedded models' tokenizer is trained on (`tokenizer_build.py`).

Plain English about serving language models, with digits, punctuation, code-like lines and the
chat template's role headers, so that common words, numbers and the template get merges.
Changing a byte of it changes every seeded model's tokenizer: bump the cache folder versions
in `registry.py` when it changes.
"""

CORPUS = """\
<|system|>
You are a helpful assistant. Answer the question, then stop.
<|user|>
What does a serving engine do with a prompt?
<|assistant|>
It splits the prompt into tokens, computes the prompt once, and then generates one token at a
time until the answer is complete or the limit is reached.
<|user|>
Why split the work between a prefill worker and a decode worker?
<|assistant|>
The prefill is a large matrix product over every prompt token; the decode step reads the whole
cache to produce a single token. Keeping them apart lets each machine do the kind of work it is
good at, and the cache is handed over from one to the other when the first token is ready.
The quick brown fox jumps over the lazy dog. The five boxing wizards jump quickly.
A model reads the text from left to right. Each layer mixes the tokens it has seen so far:
attention layers look back at every earlier token, while state space layers carry a small state
forward and update it with each new token. A hybrid model uses both kinds of layers.
When two requests share the beginning of their prompts, the engine can keep what it computed for
the first one and start the second one from there. This is called prefix caching, and it saves
time for long system prompts, for documents that many questions refer to, and for the turns of
a conversation, where each turn repeats everything that was said before.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 20 32 64 100 128 256 512 1000 1024 2048 4096 65536.
Dates and times: 2026-12-01 10:30:00 UTC, 09:15, 23:59, 1999, 2024, 2025.
Prices and sizes: $3.50, 12.5%, 7 GB, 140 GiB, 16 KiB, 1.5 ms, 0.25 s, 3e-4, -1.0, +2.
def generate(prompt, max_tokens=16, temperature=0.0):
    tokens = tokenizer.encode(prompt)
    for step in range(max_tokens):
        logits = model(tokens)
        token = sample(logits, temperature)
        tokens.append(token)
    return tokenizer.decode(tokens)
{"model": "tiny", "prompt": "Hello, world!", "max_tokens": 8, "temperature": 0}
Question: Which of the following is a prime number?
A. 4
B. 6
C. 7
D. 9
Answer: C
Question: What is the capital of France?
A. Berlin
B. Madrid
C. Paris
D. Rome
Answer: C
Question: How many legs does a spider have?
Answer: eight
The river flows to the sea. The sun rises in the east and sets in the west. Water boils at one
hundred degrees at sea level. Plants need light, water and air. The moon goes around the earth,
and the earth goes around the sun. A year has twelve months, a week has seven days, and a day has
twenty four hours. There are four seasons: spring, summer, autumn and winter.
She said that they would meet again on Monday, but he was not sure it would work. "We will see,"
he answered, and they both laughed. It was late; the train had already left the station.
Good morning! How are you today? I am fine, thank you. Could you please help me with this task?
Of course. Let me read it first, and then I will tell you what I think about it.
Serving engineers measure the time to the first token, the time between tokens, the number of
requests a machine can serve each second, and the accuracy of the answers on standard tasks.
A new engine is trusted when its answers match the reference implementation token for token.
"""
