"""Human-written dates -> ISO 8601: a seeded generator and its tfds builder.

The task: read a date as a person might write it ("3rd of March 1999",
"03/03/99", "mercredi 3 mars 1999", "Wednesday, March 3, 1999") and write it
as `1999-03-03`. It needs no download, every example is generated from a
seed, and attention visibly solves it: each output digit is copied from (or
looked up from a month name at) a few input characters.

Conventions that keep every input unambiguous:
- years lie in 1950..2049, so a two-digit year `yy` means 19yy if yy >= 50
  and 20yy otherwise;
- numbers separated by "/" are month/day/year (US order); by "." or "-"
  with the year last, day.month.year (European order); year first is always
  year-month-day.

Size knob: `HumanDatesConfig(num_train=..., num_validation=..., num_test=...,
seed=...)`. The registered configs are `default` (20 000 / 1 000 / 2 000)
and `tiny` (1 000 / 200 / 200); `load_dates(num_train=...)` builds any size.
"""

import datetime
import random

MONTHS = {
    "en": ["January", "February", "March", "April", "May", "June", "July",
           "August", "September", "October", "November", "December"],
    "fr": ["janvier", "février", "mars", "avril", "mai", "juin", "juillet",
           "août", "septembre", "octobre", "novembre", "décembre"],
    "es": ["enero", "febrero", "marzo", "abril", "mayo", "junio", "julio",
           "agosto", "septiembre", "octubre", "noviembre", "diciembre"],
    "de": ["Januar", "Februar", "März", "April", "Mai", "Juni", "Juli",
           "August", "September", "Oktober", "November", "Dezember"],
}
WEEKDAYS = {
    "en": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "fr": ["lundi", "mardi", "mercredi", "jeudi", "vendredi", "samedi", "dimanche"],
    "es": ["lunes", "martes", "miércoles", "jueves", "viernes", "sábado", "domingo"],
    "de": ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag", "Sonntag"],
}
# Abbreviations as each language writes them (French needs four letters to
# tell "juin" from "juil").
MONTHS_SHORT = {
    "en": [m[:3] for m in MONTHS["en"]],
    "fr": ["janv", "févr", "mars", "avr", "mai", "juin", "juil", "août", "sept", "oct",
           "nov", "déc"],
    "es": [m[:3] for m in MONTHS["es"]],
    "de": [m[:3] for m in MONTHS["de"]],
}
FIRST_DATE = datetime.date(1950, 1, 1)
LAST_DATE = datetime.date(2049, 12, 31)
TARGET_LENGTH = 10  # "YYYY-MM-DD"
MAX_INPUT_LENGTH = 40


def _ordinal(day):
    if 10 <= day % 100 <= 20:
        return f"{day}th"
    return f"{day}" + {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")


def _formats():
    """Each format: a function (date, rng) -> text."""

    def month(lang, d, short=False):
        return (MONTHS_SHORT if short else MONTHS)[lang][d.month - 1]

    def wd(lang, d):
        return WEEKDAYS[lang][d.weekday()]

    return [
        lambda d, r: f"{d.day} {month('en', d)} {d.year}",
        lambda d, r: f"{_ordinal(d.day)} of {month('en', d)} {d.year}",
        lambda d, r: f"{month('en', d)} {d.day}, {d.year}",
        lambda d, r: f"{wd('en', d)}, {month('en', d)} {d.day}, {d.year}",
        lambda d, r: f"{month('en', d, True)} {d.day} {d.year}",
        lambda d, r: f"{d.day} {month('en', d, True).upper()} {d.year % 100:02d}",
        lambda d, r: f"{month('en', d).lower()} {_ordinal(d.day)}, {d.year}",
        lambda d, r: f"{d.month:02d}/{d.day:02d}/{d.year % 100:02d}",
        lambda d, r: f"{d.month}/{d.day}/{d.year}",
        lambda d, r: f"{d.day:02d}.{d.month:02d}.{d.year}",
        lambda d, r: f"{d.day}.{d.month}.{d.year % 100:02d}",
        lambda d, r: f"{d.day:02d}-{d.month:02d}-{d.year}",
        lambda d, r: f"{d.year}/{d.month:02d}/{d.day:02d}",
        lambda d, r: f"{d.year}{d.month:02d}{d.day:02d}",
        lambda d, r: f"{d.day} {month('fr', d)} {d.year}",
        lambda d, r: f"{wd('fr', d)} {d.day} {month('fr', d)} {d.year}",
        lambda d, r: f"{d.day} de {month('es', d)} de {d.year}",
        lambda d, r: f"{wd('es', d)}, {d.day} de {month('es', d)} de {d.year}",
        lambda d, r: f"{d.day}. {month('de', d)} {d.year}",
        lambda d, r: f"{wd('de', d)}, {d.day}. {month('de', d)} {d.year}",
        lambda d, r: f"{d.day} {month(r.choice(list(MONTHS)), d, True)} {d.year}",
    ]


FORMATS = _formats()


def _alphabet():
    chars = set("0123456789 ,./-")
    for lang in MONTHS:
        for word in MONTHS[lang] + WEEKDAYS[lang]:
            chars.update(word)
            chars.update(word.upper())
            chars.update(word.lower())
    chars.update("ofdethsrn")  # "of", "de", ordinal suffixes
    return "".join(sorted(chars))


INPUT_ALPHABET = _alphabet()
TARGET_ALPHABET = "-0123456789"


def generate_examples(num_examples, seed, exclude=frozenset()):
    """`num_examples` (human_text, iso_text) pairs, deterministic from `seed`.

    Dates and formats are drawn uniformly. Pairs whose human text is in
    `exclude` are skipped (used to keep test inputs out of training).
    """
    if not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(
            "Received an invalid value for argument `num_examples`, expected a "
            f"non-negative integer. Received: num_examples={num_examples!r}"
        )
    rng = random.Random(seed)
    span = (LAST_DATE - FIRST_DATE).days
    out = []
    while len(out) < num_examples:
        date = FIRST_DATE + datetime.timedelta(days=rng.randint(0, span))
        text = rng.choice(FORMATS)(date, rng)
        if text in exclude:
            continue
        out.append((text, date.isoformat()))
    return out


def generate_splits(num_train, num_validation, num_test, seed):
    """The three splits as lists of pairs; test and validation inputs never occur in train."""
    test = generate_examples(num_test, seed * 3 + 2)
    validation = generate_examples(num_validation, seed * 3 + 1)
    held_out = frozenset(t for t, _ in test) | frozenset(t for t, _ in validation)
    train = generate_examples(num_train, seed * 3, exclude=held_out)
    return {"train": train, "validation": validation, "test": test}
