"""A broad, seeded set of chat prompts for self-distillation: the target answers them, the draft
learns from the answers.

The set covers the kinds of traffic a chat server sees (writing, roleplay, reasoning, arithmetic
and word problems, coding, extraction, science, humanities, translation, question answering, and,
built from the target's own earlier answers, summarization and retrieval-augmented questions).
Every prompt is composed here from templates and word lists; none comes from a benchmark, so
acceptance measured on a benchmark is acceptance on unseen prompts.
"""
from __future__ import annotations

import random

TOPICS = """the water cycle; volcanoes; black holes; the Roman Empire; the printing press; photosynthesis;
machine learning; climate change; the human heart; honeybees; the stock market; renewable energy;
the French Revolution; ancient Egypt; vaccines; the internet; plate tectonics; coral reefs; jazz music;
the Renaissance; electric cars; sleep; coffee; chess; the moon landing; democracy; inflation; bread baking;
rainforests; the immune system; quantum computing; the Silk Road; gardening; marathon running; recycling;
the Great Wall of China; earthquakes; social media; the periodic table; dinosaurs; meditation; tea;
the Industrial Revolution; mountains; friendship; public libraries; robots; the ocean tides; solar panels;
World War I; the Olympic Games; bicycles; volunteering; smartphones; nutrition; cloud computing; bridges;
the theory of evolution; wolves; the Amazon river; opera; urban planning; time management; electricity;
antibiotics; the Moon; poetry; space telescopes; board games; the Cold War; migration of birds; glaciers;
cryptography; museums; the human brain; wind turbines; the history of money; deserts; kindness; penguins;
public speaking; the Ottoman Empire; genetics; architecture; hurricanes; remote work; the Beatles;
video games; first aid; languages; ancient Greece; pollution; the metric system; airplanes; forests;
cheese making; the Arctic; mathematics; elections; photography; trains; artificial intelligence""".split(";")
TOPICS = [t.strip() for t in TOPICS]

PEOPLE = ["a teacher", "a nurse", "a software engineer", "a farmer", "a pirate captain", "a detective",
          "a medieval knight", "a tour guide", "a chef", "an astronaut", "a librarian", "a museum curator",
          "a personal trainer", "a travel agent", "a customer support agent", "a wise old wizard",
          "a sports commentator", "a startup founder", "a park ranger", "a history professor"]
NAMES = ["Alice", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Keiko", "Liam",
         "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "pencils", "cookies", "marbles", "books", "stickers", "oranges", "cupcakes", "shells", "cards"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
GERMAN = ["Das Wetter ist heute sehr schön.", "Ich habe gestern ein interessantes Buch gelesen.",
          "Die Stadt hat einen neuen Bahnhof gebaut.", "Wir treffen uns morgen um acht Uhr vor dem Kino.",
          "Der Zug hatte wegen des Schnees zwei Stunden Verspätung.", "Meine Schwester studiert Medizin in Berlin.",
          "Die Regierung plant, die Steuern im nächsten Jahr zu senken.", "Kannst du mir bitte das Salz geben?",
          "Das Museum ist montags geschlossen.", "Viele Menschen fahren im Sommer an die Ostsee.",
          "Der Hund spielt gern mit dem Ball im Garten.", "Die Konferenz wurde auf nächste Woche verschoben.",
          "Er arbeitet seit zehn Jahren als Ingenieur bei einer großen Firma.",
          "Im Herbst fallen die Blätter von den Bäumen.", "Die Mannschaft hat das Spiel knapp gewonnen.",
          "Wir müssen mehr für den Umweltschutz tun.", "Das Restaurant an der Ecke hat sehr gutes Essen.",
          "Die Kinder lernen in der Schule zwei Fremdsprachen.", "Der Präsident hielt gestern eine lange Rede.",
          "Nach dem Regen schien endlich wieder die Sonne."]

WRITING = ["Write a short story about {topic}.", "Write a poem about {topic}.",
           "Write a persuasive essay arguing why everyone should learn about {topic}.",
           "Draft a professional email to a colleague proposing a workshop on {topic}.",
           "Write a blog post introduction about {topic}.", "Write a product description for a book about {topic}.",
           "Write a speech for a school assembly about {topic}.", "Write a haiku about {topic}.",
           "Write a news article about a new discovery related to {topic}.",
           "Write a detailed, multi-paragraph article explaining {topic} to a general audience."]
ROLEPLAY = ["Pretend you are {person}. Describe your typical day.",
            "You are {person}. Give advice to someone who is nervous about their first day at work.",
            "Act as {person} and explain {topic} to a group of children.",
            "Imagine you are {person} meeting a time traveler. What do you tell them about your job?",
            "Role-play as {person} answering a customer's complaint politely."]
REASONING = ["{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
             "If all {x} are {y}s and some {y}s are green, can we conclude that some {x} are green? Explain.",
             "{a} has twice as many {item} as {b}. Together they have {n3} {item}. How many does each have?",
             "A clock shows {h}:00. What time will it show after {k} hours? Explain step by step.",
             "There are {n1} people in a room and each shakes hands with every other person once. "
             "How many handshakes happen?"]
MATH = ["What is {n1} times {n2}?", "What is {n1} plus {n2} minus {n3}?", "Solve for x: {n1}x + {n2} = {n4}.",
        "What is {p} percent of {n4}?", "Find the area of a rectangle with sides {n1} and {n2}.",
        "Is {n4} a prime number? Explain.", "Simplify the fraction {n1}/{n5}.",
        "What is the average of {n1}, {n2} and {n3}?"]
WORD_PROBLEMS = ["{a} buys {n1} {item} for ${n2} each and pays with a ${n6} bill. How much change does {a} get?",
                 "{a} reads {n1} pages a day. How many pages does {a} read in {k} weeks?",
                 "A shop sold {n4} {item} on Monday and {n3} fewer on Tuesday. How many were sold in total?",
                 "{a} has {n4} {item}. {a} gives {n1} to {b} and then buys {n2} more. How many does {a} have now?",
                 "A train travels at {n2} km per hour for {k} hours. How far does it go?",
                 "{a} earns ${n2} per hour and works {n1} hours a week. How much does {a} earn in {k} weeks?"]
CODING = ["Write a Python function that {task}.", "Write a JavaScript function that {task}.",
          "Explain how to write a program that {task}, then give the code.",
          "Write a SQL query that {sql}.", "What is the difference between a list and a tuple in Python?",
          "Explain recursion with a simple Python example.", "Write a C function that {task}.",
          "Find the bug in this code and fix it:\n\ndef average(values):\n    return sum(values) / len(values) + 1"]
TASKS = ["reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
         "counts the vowels in a string", "sorts a list of numbers with bubble sort", "finds the largest element of a list",
         "removes duplicates from a list", "checks whether a word is a palindrome", "computes the factorial of n",
         "merges two sorted lists", "converts Celsius to Fahrenheit", "counts the words in a text file"]
SQL = ["selects all customers from Paris", "counts the orders per customer", "finds the five most expensive products",
       "lists employees hired after 2020 ordered by salary"]
EXTRACTION = ["Extract every name and date from this text: \"{a} met {b} on March {d}, and {c} joined them on April {e}.\"",
              "List the numbers mentioned in this sentence and add them up: \"{a} bought {n1} {item}, "
              "{b} bought {n2}, and {c} bought {n3}.\"",
              "Classify each of these words as an animal, a plant or a tool: hammer, oak, penguin, rose, saw, wolf.",
              "Return a JSON object with the keys name, age and city for: {a} is {n1} years old and lives in Lisbon."]
STEM = ["Explain {topic} in simple terms.", "What are the main scientific principles behind {topic}?",
        "How does {topic} affect everyday life?", "What are three common misconceptions about {topic}?",
        "Describe the history of research on {topic}."]
HUMANITIES = ["What can {topic} teach us about society?", "Discuss the cultural importance of {topic}.",
              "Compare two different perspectives on {topic}.", "What ethical questions does {topic} raise?",
              "How has {topic} changed over the last century?"]
QA = ["What is {topic}?", "Who first studied {topic}?", "Why is {topic} important?", "Give three facts about {topic}.",
      "What is the capital of {country}?", "How many legs does a {animal} have?", "What language is spoken in {country}?",
      "When did {event} happen?"]
COUNTRIES = ["Japan", "Brazil", "Canada", "Egypt", "Norway", "Kenya", "Argentina", "Vietnam", "Poland", "Mexico"]
ANIMALS = ["spider", "horse", "bird", "ant", "octopus", "dog", "crab", "snake"]
EVENTS = ["the fall of the Berlin Wall", "the first moon landing", "the invention of the telephone",
          "the signing of the Magna Carta", "the start of the First World War"]
TRANSLATION = ["Translate to {language}: {english}", "How do you say \"{english}\" in {language}?",
               "Translate German to English: {german}", "Translate this sentence into English: {german}"]
ENGLISH = ["The weather is lovely today.", "Where is the nearest train station?", "I would like a cup of coffee, please.",
           "Our meeting has been moved to Thursday.", "Thank you very much for your help.",
           "The museum opens at nine in the morning.", "My brother lives in a small village near the sea."]
FOLLOW_UPS = ["Can you make it shorter?", "Please explain that in more detail.", "Now rewrite it for a ten-year-old.",
              "Summarize your answer in three bullet points.", "Give one more example.", "Rewrite it in a more formal tone."]
# Round two: the target's own long answers become documents to summarize and to answer questions about.
DOCUMENT_PROMPTS = ["Summarize the following text in a few sentences:\n\n{doc}", "Summarize: {doc}",
                    "{doc}\n\nBased on the text above, what is the main idea?",
                    "Read the passage and answer the question.\n\nPassage: {doc}\n\nQuestion: What are the key facts "
                    "mentioned about {topic}?",
                    "{doc}\n\nList three important details from this text."]

CATEGORIES = {"writing": WRITING, "roleplay": ROLEPLAY, "reasoning": REASONING, "math": MATH,
              "math_reasoning": WORD_PROBLEMS, "coding": CODING, "extraction": EXTRACTION, "stem": STEM,
              "humanities": HUMANITIES, "qa": QA, "translation": TRANSLATION}


def _fill(template: str, rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    n1, n2, n3 = rng.randint(2, 30), rng.randint(2, 40), rng.randint(1, 20)
    values = dict(topic=rng.choice(TOPICS), person=rng.choice(PEOPLE), a=a, b=b, c=c, item=rng.choice(ITEMS),
                  n1=n1, n2=n2, n3=n3, n4=rng.randint(40, 400), n5=n1 * rng.randint(2, 6), n6=(n1 * n2 // 10 + 2) * 10,
                  p=rng.choice([10, 15, 20, 25, 50, 75]), k=rng.randint(2, 9), h=rng.randint(1, 12),
                  d=rng.randint(1, 28), e=rng.randint(1, 28), x=rng.choice(["cats", "roses", "cars"]),
                  y=rng.choice(["animal", "plant", "machine"]), task=rng.choice(TASKS), sql=rng.choice(SQL),
                  language=rng.choice(LANGUAGES), english=rng.choice(ENGLISH), german=rng.choice(GERMAN),
                  country=rng.choice(COUNTRIES), animal=rng.choice(ANIMALS), event=rng.choice(EVENTS))
    return template.format(**values)


def chat_prompts(count: int, seed: int = 0) -> list[dict]:
    """Up to `count` distinct single-turn prompts, the categories in turn: [{"id", "category", "messages"}].

    Categories with few combinations (translation, qa) run out of new prompts first; the others
    fill their place."""
    rng = random.Random(seed)
    names = list(CATEGORIES)
    rows, seen = [], set()
    for attempt in range(20 * count):
        if len(rows) == count:
            break
        category = names[attempt % len(names)]
        text = _fill(rng.choice(CATEGORIES[category]), rng)
        if text not in seen:
            seen.add(text)
            rows.append({"id": f"{category}-{len(rows)}", "category": category,
                         "messages": [{"role": "user", "content": text}]})
    return rows


def follow_up(conversation: list[dict], rng: random.Random) -> list[dict]:
    """The conversation plus a second user turn that refers back to the first answer."""
    return conversation + [{"role": "user", "content": rng.choice(FOLLOW_UPS)}]


def document_prompt(document: str, rng: random.Random) -> list[dict]:
    """A summarization / retrieval-style prompt over a document (one of the target's own answers)."""
    template = rng.choice(DOCUMENT_PROMPTS)
    return [{"role": "user", "content": template.format(doc=document.strip(), topic=rng.choice(TOPICS))}]
