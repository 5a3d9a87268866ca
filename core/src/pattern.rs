//! Topic patterns for sinks and subscriptions: `order.placed`, `order.*` (exactly one segment),
//! `order.#` (zero or more segments), `#` (everything).

use crate::limits::TOPIC_MAX_BYTES;
use crate::{Invalid, InvalidKind};

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Word(String),
    One,
    Any,
}

/// A compiled topic pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    parts: Vec<Part>,
}

impl Pattern {
    pub fn parse(text: &str) -> Result<Pattern, Invalid> {
        let refuse = |why: &str| {
            Invalid::new(InvalidKind::Parameter, format!("invalid topic pattern \"{}\": {why}", text.escape_debug()))
                .with_hint("a pattern is a topic whose segments may be '*' (one segment) or '#' (any number), e.g. order.* or billing.#")
        };
        if text.is_empty() {
            return Err(refuse("it is empty"));
        }
        if text.len() > TOPIC_MAX_BYTES {
            return Err(refuse("it is too long"));
        }
        let parts = text
            .split('.')
            .map(|segment| match segment {
                "*" => Ok(Part::One),
                "#" => Ok(Part::Any),
                "" => Err(refuse("it has an empty segment")),
                word => {
                    crate::topic::validate(word).map_err(|_| {
                        refuse(&format!(
                            "segment \"{}\" is not a topic segment",
                            word.escape_debug()
                        ))
                    })?;
                    Ok(Part::Word(word.to_string()))
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        // `#.#` means what `#` means; collapsed, so that the regex and the matcher stay small.
        let mut collapsed: Vec<Part> = Vec::with_capacity(parts.len());
        for part in parts {
            if !(part == Part::Any && collapsed.last() == Some(&Part::Any)) {
                collapsed.push(part);
            }
        }
        Ok(Pattern { parts: collapsed })
    }

    /// Whether `topic` matches, in time proportional to (pattern parts x topic segments) whatever
    /// the pattern: a backtracking matcher took exponential time on `#.x.#.x.#...` (every worker
    /// evaluates tenants' patterns, so their cost must be bounded).
    pub fn matches(&self, topic: &str) -> bool {
        let segments: Vec<&str> = topic.split('.').collect();
        // reach[j]: the parts matched so far can end just before segment j.
        let mut reach = vec![false; segments.len() + 1];
        reach[0] = true;
        for part in &self.parts {
            let mut next = vec![false; segments.len() + 1];
            match part {
                Part::Any => {
                    let mut on = false;
                    for j in 0..=segments.len() {
                        on |= reach[j];
                        next[j] = on;
                    }
                }
                Part::One => next[1..].copy_from_slice(&reach[..segments.len()]),
                Part::Word(w) => {
                    for j in 0..segments.len() {
                        next[j + 1] = reach[j] && segments[j] == w.as_str();
                    }
                }
            }
            reach = next;
        }
        reach[segments.len()]
    }

    /// An equivalent POSIX regular expression over the whole topic, for filtering inside SQL.
    pub fn to_regex(&self) -> String {
        // Segments are [A-Za-z0-9_-]+, so no character of a word needs escaping but '-', which is
        // literal outside brackets anyway.
        let mut re = String::from("^");
        let mut need_dot = false;
        for part in &self.parts {
            match part {
                Part::Word(w) => {
                    if need_dot {
                        re.push_str("\\.");
                    }
                    re.push_str(w);
                    need_dot = true;
                }
                Part::One => {
                    if need_dot {
                        re.push_str("\\.");
                    }
                    re.push_str("[^.]+");
                    need_dot = true;
                }
                Part::Any => {
                    // zero or more whole segments, keeping dots balanced
                    if need_dot {
                        re.push_str("(\\.[^.]+)*");
                    } else {
                        re.push_str("([^.]+(\\.|$))*");
                        // a following part must not add its own leading dot: the group ate it
                        need_dot = false;
                        continue;
                    }
                }
            }
        }
        re.push('$');
        re
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOPICS: &[&str] = &[
        "order",
        "order.placed",
        "order.placed.v2",
        "order.shipped",
        "billing.invoice.paid",
        "a.b.c.d",
    ];

    fn check(pattern: &str, expected: &[&str]) {
        let p = Pattern::parse(pattern).unwrap();
        let got: Vec<&str> = TOPICS.iter().copied().filter(|t| p.matches(t)).collect();
        assert_eq!(got, expected, "{pattern}");
    }

    #[test]
    fn wildcards() {
        check("order.placed", &["order.placed"]);
        check("order.*", &["order.placed", "order.shipped"]);
        check(
            "order.#",
            &["order", "order.placed", "order.placed.v2", "order.shipped"],
        );
        check("#", TOPICS);
        check("*.*.paid", &["billing.invoice.paid"]);
        check("#.paid", &["billing.invoice.paid"]);
        check("a.#.d", &["a.b.c.d"]);
        check("*", &["order"]);
        check("#.placed.#", &["order.placed", "order.placed.v2"]);
    }

    #[test]
    fn matching_cost_is_bounded_whatever_the_pattern() {
        // 40 '#' between words against a topic of 120 segments that almost matches: the
        // backtracking matcher this replaced did not finish; this one takes microseconds.
        let pattern = vec!["#.x"; 40].join(".") + ".y";
        let topic = vec!["x"; 120].join(".") + ".z";
        let p = Pattern::parse(&pattern).unwrap();
        let start = std::time::Instant::now();
        assert!(!p.matches(&topic));
        assert!(p.matches(&(vec!["x"; 120].join(".") + ".y")));
        assert!(start.elapsed() < std::time::Duration::from_secs(2));
        // Consecutive '#' collapse into one.
        assert_eq!(
            Pattern::parse("a.#.#.#.b").unwrap(),
            Pattern::parse("a.#.b").unwrap()
        );
    }

    #[test]
    fn the_regex_agrees_with_the_matcher() {
        let patterns = [
            "order.placed",
            "order.*",
            "order.#",
            "#",
            "*.*.paid",
            "#.paid",
            "a.#.d",
            "*",
            "#.placed.#",
            "#.#",
            "*.#",
            "#.*",
            "a.*.#.d",
            "#.b.#",
            "a.#.#.d",
        ];
        let more = [
            "a.d",
            "a",
            "paid",
            "xpaid",
            "a.b",
            "b",
            "a.b.d",
            "x.b.y",
            "orders.placed",
            "order.placedx",
        ];
        let topics = TOPICS.iter().chain(more.iter());
        for p in patterns {
            let pattern = Pattern::parse(p).unwrap();
            let re = regex::Regex::new(&pattern.to_regex()).unwrap();
            for &t in topics.clone() {
                assert_eq!(
                    re.is_match(t),
                    pattern.matches(t),
                    "pattern {p} ({}) on {t}",
                    pattern.to_regex()
                );
            }
        }
    }

    #[test]
    fn refusals() {
        for bad in [
            "",
            ".",
            "order.",
            "order..x",
            "ord*",
            "or#der",
            "order placed",
            "a.b/c",
        ] {
            assert_eq!(
                Pattern::parse(bad).unwrap_err().kind,
                InvalidKind::Parameter,
                "{bad:?}"
            );
        }
    }
}
