"""The workloads of P9 ``spec``: chat requests that quote their prompt, and ones that do not.

``COPY_HEAVY``: 16 edits and summaries of a given passage (8 passages, prose and code, two tasks
each): the answer mostly repeats the passage, as code edits, corrections and RAG answers do.
``NO_COPY``: 16 open questions whose answers have nothing to quote. Both are plain chat
messages (the model's chat template is applied), fixed, shipped here so every run and the tests
use the same ones.
"""

from __future__ import annotations

from typing import Any

PROSE = [
    "The Industrial Revolution began in Great Britain in the late eighteenth century. New "
    "machines such as the spinning jenny and the steam engine changed how goods were made. "
    "Factories replaced home workshops, and many families moved from farms to growing cities "
    "to find work. Railways and canals made it cheaper to move coal, iron and finished goods "
    "across the country, and by the middle of the nineteenth century Britain produced more "
    "cloth and iron than any other nation.",
    "Honey bees live in colonies of up to sixty thousand workers, a few hundred drones and a "
    "single queen. The workers build the comb from wax, feed the larvae, guard the entrance "
    "and fly out to collect nectar and pollen. A forager that finds a rich patch of flowers "
    "returns to the hive and performs a waggle dance, which tells her sisters the direction "
    "and the distance of the food. In winter the colony clusters together and keeps warm by "
    "shivering its flight muscles.",
    "To replace a bicycle inner tube, first shift to the smallest rear cog and open the brake. "
    "Remove the wheel, let out any remaining air and push the tyre bead into the centre of the "
    "rim. Use two tyre levers to lift one side of the tyre over the rim, then pull out the old "
    "tube. Check the inside of the tyre for thorns or glass. Put a little air into the new "
    "tube, fit it inside the tyre, push the bead back over the rim with your thumbs and "
    "inflate it to the pressure printed on the sidewall.",
    "Our quarterly results show revenue of 4.2 million dollars, up twelve percent from the "
    "same quarter last year. Subscription income grew faster than hardware sales, and the new "
    "support plan signed three hundred customers in its first month. Operating costs rose "
    "because we hired eleven engineers and opened an office in Lisbon. We expect the next "
    "quarter to be slower, as two large contracts end in June, but the pipeline of new deals "
    "is the strongest it has been since the company was founded.",
]

CODE = [
    "def compute_total(items):\n"
    "    total = 0\n"
    "    for item in items:\n"
    "        if item.price > 0:\n"
    "            total += item.price * item.quantity\n"
    "    if total > 100:\n"
    "        total = total * 0.9\n"
    "    return total\n"
    "\n"
    "\n"
    "def format_receipt(items):\n"
    "    lines = []\n"
    "    for item in items:\n"
    "        lines.append(f'{item.name}: {item.quantity} x {item.price}')\n"
    "    lines.append(f'Total: {compute_total(items)}')\n"
    "    return '\\n'.join(lines)\n",
    "class Stack:\n"
    "    def __init__(self):\n"
    "        self.items = []\n"
    "\n"
    "    def push(self, item):\n"
    "        self.items.append(item)\n"
    "\n"
    "    def pop(self):\n"
    "        if not self.items:\n"
    "            raise IndexError('pop from an empty stack')\n"
    "        return self.items.pop()\n"
    "\n"
    "    def peek(self):\n"
    "        if not self.items:\n"
    "            return None\n"
    "        return self.items[-1]\n"
    "\n"
    "    def size(self):\n"
    "        return len(self.items)\n",
    "function fetchUsers(url) {\n"
    "  return fetch(url)\n"
    "    .then((response) => {\n"
    "      if (!response.ok) {\n"
    "        throw new Error('Request failed: ' + response.status);\n"
    "      }\n"
    "      return response.json();\n"
    "    })\n"
    "    .then((data) => data.users.filter((user) => user.active))\n"
    "    .catch((error) => {\n"
    "      console.error(error);\n"
    "      return [];\n"
    "    });\n"
    "}\n",
    "SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.amount) AS total\n"
    "FROM customers\n"
    "JOIN orders ON orders.customer_id = customers.id\n"
    "WHERE orders.created_at >= '2024-01-01'\n"
    "GROUP BY customers.name\n"
    "HAVING COUNT(orders.id) > 3\n"
    "ORDER BY total DESC\n"
    "LIMIT 20;\n",
]

PROSE_TASKS = [
    "Repeat the following text exactly as it is written, word for word:\n\n{}",
    "Rewrite the following text with British spelling checked and return the whole text, "
    "unchanged otherwise:\n\n{}",
]
CODE_TASKS = [
    "Here is some code:\n\n{}\nRepeat the code exactly, with a short comment added above "
    "the first line.",
    "Rename every variable called `items` or `item` to `entries` or `entry` (or make no "
    "change where there is none) and return the complete code:\n\n{}",
]

NO_COPY = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a birthday party for a seven-year-old.",
    "What are the main differences between a cat and a dog as pets?",
    "Write a poem about the first snow of winter.",
    "Describe a day in the life of a medieval blacksmith.",
    "How does a refrigerator keep food cold?",
    "Suggest a three-day itinerary for a trip to Rome.",
    "Why do people enjoy listening to music?",
    "Write a letter to a friend describing your new job.",
    "What should I consider when buying my first car?",
    "Explain how vaccines help the immune system.",
    "Invent a new board game and explain its rules.",
    "What are some good habits for studying effectively?",
    "Describe the water cycle in simple terms.",
    "Write a short dialogue between a robot and a gardener.",
]


def copy_heavy() -> list[list[dict[str, Any]]]:
    """16 conversations whose answers quote the passage they give."""
    convs: list[list[dict[str, Any]]] = []
    for text in PROSE:
        convs.extend([{"role": "user", "content": t.format(text)}] for t in PROSE_TASKS)
    for code in CODE:
        convs.extend([{"role": "user", "content": t.format(code)}] for t in CODE_TASKS)
    return convs


def no_copy() -> list[list[dict[str, Any]]]:
    """16 conversations whose answers have nothing to quote."""
    return [[{"role": "user", "content": q}] for q in NO_COPY]
