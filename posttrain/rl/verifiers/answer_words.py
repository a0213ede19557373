"""The closed lists of words an answer is read with (`answer_grammar`): units, the links and
connectives of a sentence, and the words that change a claim, by what they do to it (negations,
hedges, alternatives, corrections, magnitudes, bounds). Compared lower-cased, symbols as written."""

from __future__ import annotations

OPERATORS = frozenset(
    {"+", "-", "*", "/", "^", "=", "!", "<", ">", "\\times", "\\cdot", "\\div", "\\pm", "\\mp", "\\leq", "\\geq"}
    | {"\\le", "\\ge", "\\lt", "\\gt", "\\neq", "\\approx", "\\sim", "\\sqrt", "_", "\\ne"}
)
JOINERS = frozenset({",", "and", "or", "to", "through", "thru", "until", "till", "-", "&", "/", "nor", "vs"})
LINKS = frozenset(
    {"=", ":", "is", "are", "was", "were", "be", "equals", "equal", "makes", "make", "gives", "give", "get", "gets"}
    | {"got", "yields", "totals", "totaling", "totalling", "\\Rightarrow", "\\to", "\\implies", "→", "\\rightarrow"}
)
CONNECTIVES = frozenset(
    {"because", "since", "as", "given", "from", "using", "via", "by", "which", "where", "so", "thus", "hence"}
    | {"therefore", "that", "after", "when", "for", "with", "in", "on", "per", "each", "every", "(", ";", "—"}
)
_NEGATIONS = {"not", "no", "never", "none", "nor", "neither", "cannot", "incorrect", "wrong", "false", "nope"}
_HEDGES = {"maybe", "perhaps", "probably", "possibly", "possible", "likely", "unlikely", "guess", "unsure"}
_HEDGES |= {"uncertain", "might", "approximately", "approx", "roughly", "estimate", "estimated", "ish"}
_ALTERNATIVES = {"or", "either", "alternatively", "otherwise"}
_CORRECTIONS = {"wait", "actually", "correction", "instead", "rather", "oops", "sorry", "mistake", "hmm", "unless"}
CHANGERS = frozenset(_NEGATIONS | _HEDGES | _ALTERNATIVES | _CORRECTIONS | {"?", "\\pm", "\\mp", "\\approx"})
MAGNITUDES = frozenset(
    {"hundred", "hundreds", "thousand", "thousands", "million", "millions", "billion", "billions", "trillion"}
    | {"trillions", "dozen", "dozens", "k", "bn", "mn", "mil", "grand", "lakh", "crore"}
)
REMAINDER_CHANGERS = frozenset({"plus", "max", "maximum", "minimum", "tops", "upward", "upwards"})
AND_BOUNDS = frozenset({"up", "above", "over", "more", "higher", "beyond", "greater", "upward", "upwards", "below"})
LEAD_CHANGERS = frozenset(
    {"least", "most", "more", "less", "fewer", "greater", "larger", "smaller", "higher", "lower", "over", "under"}
    | {"above", "below", "up", "upwards", "exceeds", "exceeding", "beyond", "between", "from", "range", "ranging"}
    | {"about", "around", "nearly", "almost", "some", "close", "near", "maximum", "minimum", "max", "min", "than"}
    | {"~", "<", ">", "\\leq", "\\geq", "\\le", "\\ge", "\\lt", "\\gt", "\\sim", "\\approx", "\\neq", "\\ne"}
)
_UNITS = {
    *"mm cm m km in inch inches ft foot feet yd yds yard yards mi mile miles meter meters metre metres".split(),
    *"centimeter centimeters centimetre centimetres millimeter millimeters kilometer kilometers kilometre".split(),
    *"kilometres mg g kg gram grams kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons".split(),
    *"tonne tonnes ml l liter liters litre litres gal gallon gallons qt quart quarts pt pint pints cup".split(),
    *"cups tbsp tsp tablespoon tablespoons teaspoon teaspoons cc s sec secs second seconds min mins minute".split(),
    *"minutes h hr hrs hour hours day days week weeks wk wks month months mo year years yr yrs decade".split(),
    *"decades mph kph kmh fps rpm bpm dollar dollars cent cents usd euro euros penny pennies degree".split(),
    *"degrees deg radian radians rad unit units cal kcal calorie calories w kw kwh watt watts v volt".split(),
    *"volts j joule joules n pa hz gb mb kb tb".split(),
}
UNIT_WORDS = frozenset(_UNITS)
UNIT_PREFIXES = frozenset({"sq", "square", "cubic", "cu"})
