"""Varied training prompts for self-distillation, written by the project (no dataset download).

Templates x topics give a few thousand chat-style requests (advice, explanations, stories, code,
arithmetic, translation, summaries). Topics come from the lists below plus the names of Python's
standard-library modules (they ship with every machine). The split into train / validation is by
a hash of the prompt text, so it is stable as lists grow. The benchmark prompts
(every prompt set under `specdec_rt/tooling/data`) are never used for training: they are removed here.
"""

from __future__ import annotations

import hashlib
import random
import sys

__all__ = ["training_prompts", "split_of"]

THINGS = """black holes; photosynthesis; the water cycle; volcanoes; earthquakes; rainbows; tides;
the moon landing; the printing press; the internet; electricity; magnets; gravity; vaccines;
the immune system; sleep; dreams; memory; habits; coffee; tea; chocolate; bread baking; pizza;
gardening; houseplants; composting; recycling; solar power; wind turbines; electric cars; bicycles;
trains; airplanes; submarines; rockets; satellites; the stock market; inflation; budgeting; saving
money; credit cards; interest rates; taxes; renting an apartment; moving to a new city; job
interviews; writing a resume; public speaking; time management; procrastination; meditation;
yoga; running; swimming; chess; video games; board games; photography; painting; learning the
guitar; learning a new language; reading more books; writing a novel; poetry; jazz; classical
music; the Roman Empire; ancient Egypt; the Renaissance; the Industrial Revolution; democracy;
the scientific method; evolution; DNA; cells; bacteria; viruses; the human heart; the brain;
nutrition; vitamins; drinking water; camping; hiking; traveling on a budget; packing a suitcase;
dogs; cats; birds; bees; dolphins; elephants; penguins; rainforests; deserts; oceans; glaciers;
climate change; weather forecasts; clouds; snow; thunderstorms; friendship; kindness; teamwork;
leadership; negotiation; giving feedback; remote work; open-plan offices; email etiquette;
social media; online privacy; passwords; backups; cloud computing; databases; machine learning;
neural networks; robots; 3D printing; smartphones; batteries; the periodic table; atoms; light;
sound; music theory; birthdays; weddings; holidays; cooking rice; making soup; salads; breakfast;
a picnic; a rainy day; a lighthouse; a dragon; a lost key; a tiny robot; a talking tree; the last
bookstore; a time traveler; a city under the sea; a friendly ghost; a snowman; a pirate ship""".replace("\n", " ")

ACTIVITIES = """staying healthy; studying for exams; learning to code; cooking for one; sleeping
better; making friends as an adult; keeping a journal; starting a small business; caring for a
puppy; training for a 5k; decorating a small room; cleaning the kitchen; planning a trip; hosting
a dinner party; reducing stress; staying motivated; working from home; learning to draw; saving
for retirement; talking to a difficult coworker; preparing for a presentation; teaching kids to
read; growing tomatoes; reducing screen time; organizing a closet; writing clearly; negotiating a
salary; choosing a laptop; buying a used car; keeping plants alive""".replace("\n", " ")

CHAT = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Tell me three interesting facts about {t}.",
    "Why is {t} important?",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a short story about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a child?",
    "Give me a fun fact about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What are common misconceptions about {t}?",
    "Write a limerick about {t}.",
    "Describe {t} in one paragraph.",
    "What questions should I ask to learn more about {t}?",
    "How does {t} affect everyday life?",
    "Can you write a tweet about {t}?",
    "Give me a quiz question about {t} with the answer.",
]
ADVICE = [
    "Give me three tips for {a}.",
    "How can I get better at {a}?",
    "What is a good routine for {a}?",
    "What mistakes should beginners avoid when {a}?",
    "Make a simple plan for {a}.",
    "I want to start {a}. Where do I begin?",
    "List five ideas for {a}.",
    "What should I know before {a}?",
]
CODE = [
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
    "Explain how to write a function that {c}.",
    "Write a short Python script that {c}.",
]
CODE_TASKS = """reverses a string; counts the vowels in a word; returns the largest number in a list;
checks whether a number is prime; sorts a list of names; removes spaces from a string; converts
Celsius to Fahrenheit; sums the digits of a number; finds the average of a list; checks whether a
year is a leap year; merges two dictionaries; counts words in a sentence; returns the factorial
of n; flattens a nested list; finds duplicate items in a list; capitalizes every word; reads a
text file and prints its lines; generates a random password; computes the greatest common
divisor; checks whether two words are anagrams; returns the second smallest number; converts a
number to binary; counts how often each letter appears; rotates a list by k places; validates an
email address roughly; computes compound interest; returns the squares of a list; finds the
longest word in a sentence""".replace("\n", " ")
MODULE_T = ["What is the Python module {m} used for?", "Show a small example that uses Python's {m} module."]
MATH = [
    "What is {x} plus {y}?",
    "What is {x} times {y}?",
    "If I have {x} apples and eat {y}, how many are left?",
    "A train travels {x} kilometers in {y} hours. What is its average speed?",
    "What is {y} percent of {x}?",
    "Solve for n: n + {y} = {x}.",
]
TRANSLATE = ["Translate into French: {s}", "Translate into Spanish: {s}", "Translate into German: {s}"]
SENTENCES = """I would like a cup of tea, please.; Where is the train station?; The weather is
lovely today.; My brother is learning to cook.; We are going to the beach tomorrow.; Thank you for
your help.; The museum opens at nine.; Can you recommend a good restaurant?; I lost my umbrella.;
She reads a book every week.; The children are playing in the garden.; How much does this cost?
""".replace("\n", " ")
SUMMARY = ["Summarize in one sentence: {p}", "What is the main idea of this text? {p}"]
PASSAGES = [
    "The city council voted to expand the bike lane network after a year of record ridership. "
    "Supporters say safer lanes cut traffic, while some shop owners worry about parking.",
    "Honeybees communicate the location of flowers with a waggle dance. The angle of the dance "
    "shows the direction relative to the sun, and its length hints at the distance.",
    "The library will close for renovation in March. During the work, books can be borrowed from "
    "a temporary branch in the community center, and online services stay available.",
    "A new study found that people who take short walks after meals have lower blood sugar "
    "levels. The effect was strongest for walks of at least ten minutes.",
    "The company reported higher sales this quarter, driven by demand for its budget phones, "
    "but profits fell because of rising shipping costs.",
]


def _items(text: str) -> list[str]:
    return [s.strip() for s in text.split(";") if s.strip()]


def _modules() -> list[str]:
    names = sorted(m for m in getattr(sys, "stdlib_module_names", ()) if not m.startswith("_"))
    return names


def _bench_prompts() -> set[str]:
    """The benchmark prompts (every shipped prompt set, ``specdec_rt/tooling/data``)."""
    from .corpus import benchmark_texts

    return {text.strip() for text in benchmark_texts()}


def split_of(prompt: str, val_fraction: float = 0.04) -> str:
    """'val' or 'train', stable: a hash of the text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") / 2**32
    return "val" if h < val_fraction else "train"


def training_prompts(seed: int = 0) -> list[str]:
    """All prompts, shuffled deterministically by ``seed`` (no benchmark prompt among them)."""
    rng = random.Random(seed)
    out: list[str] = []
    out += [t.format(t=x) for t in CHAT for x in _items(THINGS)]
    out += [t.format(a=x) for t in ADVICE for x in _items(ACTIVITIES)]
    out += [t.format(c=x) for t in CODE for x in _items(CODE_TASKS)]
    out += [t.format(m=m) for t in MODULE_T for m in _modules()]
    out += [t.format(s=s) for t in TRANSLATE for s in _items(SENTENCES)]
    out += [t.format(p=p) for t in SUMMARY for p in PASSAGES]
    for _ in range(300):
        x, y = rng.randint(10, 999), rng.randint(2, 99)
        out.append(rng.choice(MATH).format(x=x, y=y))
    bench = _bench_prompts()
    seen, unique = set(), []
    for p in out:
        if p not in seen and p not in bench:
            seen.add(p)
            unique.append(p)
    rng.shuffle(unique)
    return unique
