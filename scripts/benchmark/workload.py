"""Workload: deterministic prompts and output lengths, and the model folder."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .common import ModelSource

# Deterministic prompt material: prompts are built by concatenating these, then cut to a token count.
SENTENCES = [
    "The lighthouse keeper climbed the spiral stairs every evening to light the lamp before the fog rolled in.",
    "Photosynthesis converts sunlight, water and carbon dioxide into glucose and oxygen inside the chloroplasts.",
    "In 1969 the Apollo 11 mission landed two astronauts on the Moon while a third orbited above.",
    "A good cup of coffee depends on fresh beans, the right grind size and water just below boiling.",
    "The committee postponed its decision until the engineers could finish testing the new bridge design.",
    "Rivers carve valleys over millions of years, carrying sediment from the mountains down to the sea.",
    "She opened the old wooden box and found a bundle of letters tied with a faded blue ribbon.",
    "Compilers translate source code into machine instructions, optimising loops and removing dead code.",
    "The market was crowded with stalls selling spices, dried fruit, bright fabrics and hand-made pottery.",
    "Honeybees communicate the direction of flowers to their hive mates through a waggle dance.",
    "When the storm finally passed, the villagers came out to inspect the fallen trees and flooded roads.",
    "A balanced diet includes vegetables, whole grains, lean proteins and plenty of water every day.",
    "The orchestra tuned their instruments as the conductor walked slowly onto the stage.",
    "Glaciers store about two thirds of the fresh water on Earth, and many of them are shrinking.",
    "The detective noticed that the clock on the mantelpiece had stopped at exactly a quarter past nine.",
    "Renewable energy sources such as wind and solar power now supply a growing share of electricity.",
    "Our team meets every Monday morning to review progress, discuss blockers and plan the week ahead.",
    "The ancient library held thousands of scrolls on astronomy, medicine, poetry and mathematics.",
    "Octopuses can change the colour and texture of their skin to blend into rocks and coral.",
    "Please summarise the main arguments of the article and list any assumptions the author makes.",
    "The train left the station ten minutes late, but it made up the time on the long straight section.",
    "Volcanic soil is often very fertile, which is why farms cluster on the slopes of active volcanoes.",
    "He practised the piano for two hours a day, slowly mastering the difficult passages of the sonata.",
    "Databases use indexes to find rows quickly without scanning every record in a table.",
    "The children built a snowman with a carrot nose, pebble eyes and an old striped scarf.",
    "Explain step by step how a bill becomes a law, and give one historical example.",
    "Migrating birds navigate thousands of kilometres using the sun, the stars and the magnetic field.",
    "The recipe calls for two eggs, a cup of flour, half a cup of sugar and a pinch of salt.",
    "Write a short story about a robot who discovers that it enjoys painting sunsets.",
    "Satellites in geostationary orbit appear fixed in the sky because they circle the Earth once a day.",
]


@dataclass
class Workload:
    prompts: list[str]
    prompt_tokens: list[int]
    max_new_tokens: list[int]

    def request(self, k: int) -> tuple[int, str, int]:
        i = k % len(self.prompts)
        return i, self.prompts[i], self.max_new_tokens[i]


def build_workload(tokenizer, size: int, prompt_range: tuple[int, int], output_range: tuple[int, int]) -> Workload:
    """Deterministic and balanced in every prefix: lengths follow additive golden-ratio sequences,
    so the first 8 requests already span the ranges as the first 64 do."""
    phi = (math.sqrt(5) - 1) / 2
    prompts, prompt_tokens, outputs = [], [], []
    for i in range(size):
        u = (0.5 + i * phi) % 1.0
        v = (0.25 + i * phi * phi * 3.1) % 1.0
        target = round(prompt_range[0] + u * (prompt_range[1] - prompt_range[0]))
        outputs.append(round(output_range[0] + v * (output_range[1] - output_range[0])))
        parts, j = [], 7 * i
        while True:
            parts.append(SENTENCES[j % len(SENTENCES)])
            ids = tokenizer(" ".join(parts)).input_ids
            if len(ids) >= target:
                break
            j += 3
        text = tokenizer.decode(ids[:target], skip_special_tokens=True).strip()
        prompts.append(text)
        prompt_tokens.append(len(tokenizer(text).input_ids))
    return Workload(prompts, prompt_tokens, outputs)


def model_folder(source: ModelSource) -> str:
    """The folder the server also loads (a GGUF source converted once into safetensors)."""
    from lmi_serve.model.loader import convert_gguf, find_gguf, resolve_model_source

    cache_dir = os.path.expanduser(os.environ.get("LMI_SERVE_CACHE_DIR", "").strip() or "~/.cache/lmi-serve")
    folder = resolve_model_source(source.model_id)
    gguf = find_gguf(folder, source.gguf_file)
    return str(convert_gguf(gguf, cache_dir)) if gguf is not None else folder
