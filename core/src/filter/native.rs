//! A native evaluator for the filters most subscriptions have: comparisons of an event's text
//! fields, or of a top-level field of payload or headers, with a literal, joined by `&&`, `||`
//! and `!` (`payload.amount > 90 && tenant == "acme"`, `has(payload.vip)`,
//! `tenant in ["acme", "globex"]`).
//!
//! It reads the fields straight from the event (in fan-out, from the binary jsonb, without
//! building JSON or a CEL context) and gives a verdict only where it is certain to be CEL's: a
//! missing field, a container, a comparison of values of different kinds, anything CEL would
//! answer with an error or decide otherwise, gives no verdict, and the caller evaluates the
//! filter with CEL as before. So an event's verdict, and the error recorded for it, never
//! depend on which evaluator ran (proven against CEL in the tests below, on random filters and
//! events).

use cel::common::ast::{operators, Expr, LiteralValue};
use cel::parser::Expression;

/// A field a native filter reads.
#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Topic,
    Subject,
    Tenant,
    RaisedAt,
    /// A top-level field of payload.
    Payload(String),
    /// A top-level field of headers.
    Headers(String),
}

/// A field's value as a native filter sees it: the scalars, as CEL would be handed them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scalar<'a> {
    /// The object has no such field (CEL: an error).
    Absent,
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(&'a str),
    /// Anything else (an array, an object, a string longer than [`STRING_MAX`], a value that
    /// cannot be read): the filter is left to CEL for this event.
    Other,
}

/// The longest string a native filter compares. With at most [`FIELDS_MAX`] fields, what it
/// reads stays below the limits CEL's context has (`EVENT_TEXT_MAX`, `EVENT_VALUES_MAX`), so
/// an event CEL would refuse as too large is never decided natively.
pub const STRING_MAX: usize = 4096;

/// The most fields of payload and headers a native filter reads.
pub const FIELDS_MAX: usize = 64;

const _: () = assert!(
    FIELDS_MAX * STRING_MAX + super::MAX_BYTES < super::EVENT_TEXT_MAX
        && FIELDS_MAX + 2 < super::EVENT_VALUES_MAX
);

impl<'a> Scalar<'a> {
    /// A JSON number as CEL is handed it (`json_to_cel`): `int` when integral, else `double`.
    pub fn number(n: &serde_json::Number) -> Scalar<'static> {
        match n.as_i64() {
            Some(i) => Scalar::Int(i),
            None => Scalar::Float(n.as_f64().unwrap_or(f64::NAN)),
        }
    }

    /// A JSON string.
    pub fn string(s: &'a str) -> Scalar<'a> {
        if s.len() > STRING_MAX {
            Scalar::Other
        } else {
            Scalar::Str(s)
        }
    }

    /// A JSON value.
    pub fn of_json(v: &'a serde_json::Value) -> Scalar<'a> {
        use serde_json::Value as J;
        match v {
            J::Null => Scalar::Null,
            J::Bool(b) => Scalar::Bool(*b),
            J::Number(n) => Scalar::number(n),
            J::String(s) => Scalar::string(s),
            J::Array(_) | J::Object(_) => Scalar::Other,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Literal {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Op {
    fn of(name: &str) -> Option<Op> {
        Some(match name {
            operators::EQUALS => Op::Eq,
            operators::NOT_EQUALS => Op::Ne,
            operators::LESS => Op::Lt,
            operators::LESS_EQUALS => Op::Le,
            operators::GREATER => Op::Gt,
            operators::GREATER_EQUALS => Op::Ge,
            _ => return None,
        })
    }

    /// The operator with its operands swapped (`90 < x` is `x > 90`).
    fn swapped(self) -> Op {
        match self {
            Op::Lt => Op::Gt,
            Op::Le => Op::Ge,
            Op::Gt => Op::Lt,
            Op::Ge => Op::Le,
            same => same,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    Const(bool),
    /// A field used as a boolean.
    Truth(Operand),
    Not(Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Compare(Operand, Op, Literal),
    Has(Operand),
    In(Operand, Vec<Literal>),
}

/// A filter compiled for native evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Native {
    root: Node,
    /// The fields of payload and headers it reads: every one of them must be a plain scalar
    /// (or absent) for a verdict, as CEL refuses an event whose selected fields it cannot read.
    fields: Vec<Operand>,
}

impl Native {
    /// The filter, when it is one the native evaluator takes.
    pub fn compile(e: &Expression) -> Option<Native> {
        let root = node(e)?;
        let mut fields = Vec::new();
        root.fields(&mut fields);
        fields.dedup();
        (fields.len() <= FIELDS_MAX).then_some(Native { root, fields })
    }

    /// The verdict, when it is certain to be CEL's; None: ask CEL. `get` gives a field's value.
    pub fn verdict<'a>(&self, get: &mut impl FnMut(&Operand) -> Scalar<'a>) -> Option<bool> {
        if self.fields.iter().any(|f| get(f) == Scalar::Other) {
            return None;
        }
        self.root.eval(get)
    }
}

impl Node {
    fn fields(&self, into: &mut Vec<Operand>) {
        match self {
            Node::Const(_) => {}
            Node::Truth(o) | Node::Compare(o, ..) | Node::Has(o) | Node::In(o, _) => {
                if matches!(o, Operand::Payload(_) | Operand::Headers(_)) && !into.contains(o) {
                    into.push(o.clone());
                }
            }
            Node::Not(n) => n.fields(into),
            Node::And(a, b) | Node::Or(a, b) => {
                a.fields(into);
                b.fields(into);
            }
        }
    }

    fn eval<'a>(&self, get: &mut impl FnMut(&Operand) -> Scalar<'a>) -> Option<bool> {
        match self {
            Node::Const(b) => Some(*b),
            Node::Truth(o) => match get(o) {
                Scalar::Bool(b) => Some(b),
                _ => None,
            },
            Node::Not(n) => n.eval(get).map(|b| !b),
            // CEL's `&&`: false if either side is false, whatever the other (an error, a value
            // that is not a boolean); true if both are; otherwise an error.
            Node::And(a, b) => match a.eval(get) {
                Some(false) => Some(false),
                Some(true) => b.eval(get),
                None => b.eval(get).filter(|b| !b),
            },
            Node::Or(a, b) => match a.eval(get) {
                Some(true) => Some(true),
                Some(false) => b.eval(get),
                None => b.eval(get).filter(|b| *b),
            },
            Node::Compare(o, op, lit) => compare(get(o), *op, lit),
            Node::Has(o) => match get(o) {
                Scalar::Absent => Some(false),
                Scalar::Other => None,
                _ => Some(true),
            },
            Node::In(o, lits) => {
                let v = get(o);
                if matches!(v, Scalar::Absent | Scalar::Other) {
                    return None;
                }
                let mut found = false;
                for lit in lits {
                    found |= compare(v, Op::Eq, lit)?;
                }
                Some(found)
            }
        }
    }
}

/// `v op lit` as CEL answers it, when it answers without an error.
fn compare(v: Scalar<'_>, op: Op, lit: &Literal) -> Option<bool> {
    use std::cmp::Ordering;
    let ordering: Option<Ordering> = match (v, lit) {
        (Scalar::Absent | Scalar::Other, _) => return None,
        (Scalar::Int(a), Literal::Int(b)) => Some(a.cmp(b)),
        (Scalar::Float(a), Literal::Float(b)) => a.partial_cmp(b),
        (Scalar::Int(a), Literal::Float(b)) => (a as f64).partial_cmp(b),
        (Scalar::Float(a), Literal::Int(b)) => a.partial_cmp(&(*b as f64)),
        (Scalar::Str(a), Literal::Str(b)) => Some(a.cmp(b.as_str())),
        (Scalar::Bool(a), Literal::Bool(b)) => Some(a.cmp(b)),
        // Equality only, of the kinds left.
        (Scalar::Null, Literal::Null) => return equality(op, true),
        // Values of different kinds are never equal, and have no order.
        _ => return equality(op, false),
    };
    let ordering = ordering?;
    Some(match op {
        Op::Eq => ordering == Ordering::Equal,
        Op::Ne => ordering != Ordering::Equal,
        Op::Lt => ordering == Ordering::Less,
        Op::Le => ordering != Ordering::Greater,
        Op::Gt => ordering == Ordering::Greater,
        Op::Ge => ordering != Ordering::Less,
    })
}

fn equality(op: Op, equal: bool) -> Option<bool> {
    match op {
        Op::Eq => Some(equal),
        Op::Ne => Some(!equal),
        _ => None,
    }
}

fn node(e: &Expression) -> Option<Node> {
    match &e.expr {
        Expr::Literal(LiteralValue::Boolean(b)) => Some(Node::Const(*b.inner())),
        Expr::Select(s) if s.test => {
            let Expr::Ident(variable) = &s.operand.expr else {
                return None;
            };
            Some(Node::Has(field(variable, &s.field)?))
        }
        Expr::Select(_) | Expr::Ident(_) => operand(e).map(Node::Truth),
        Expr::Call(call) if call.target.is_none() => {
            let args = &call.args;
            match (call.func_name.as_str(), args.len()) {
                (operators::LOGICAL_NOT, 1) => Some(Node::Not(Box::new(node(&args[0])?))),
                (operators::LOGICAL_AND, 2) => Some(Node::And(
                    Box::new(node(&args[0])?),
                    Box::new(node(&args[1])?),
                )),
                (operators::LOGICAL_OR, 2) => Some(Node::Or(
                    Box::new(node(&args[0])?),
                    Box::new(node(&args[1])?),
                )),
                (operators::IN, 2) => {
                    let Expr::List(list) = &args[1].expr else {
                        return None;
                    };
                    if !list.optional_indices.is_empty() {
                        return None;
                    }
                    let lits = list.elements.iter().map(literal).collect::<Option<_>>()?;
                    Some(Node::In(operand(&args[0])?, lits))
                }
                (name, 2) => {
                    let op = Op::of(name)?;
                    match (operand(&args[0]), literal(&args[1])) {
                        (Some(o), Some(lit)) => Some(Node::Compare(o, op, lit)),
                        _ => Some(Node::Compare(
                            operand(&args[1])?,
                            op.swapped(),
                            literal(&args[0])?,
                        )),
                    }
                }
                _ => None,
            }
        }
        _ => None,
    }
}

fn operand(e: &Expression) -> Option<Operand> {
    match &e.expr {
        Expr::Ident(name) => Some(match name.as_str() {
            "topic" => Operand::Topic,
            "subject" => Operand::Subject,
            "tenant" => Operand::Tenant,
            "raised_at" => Operand::RaisedAt,
            _ => return None,
        }),
        Expr::Select(s) if !s.test => match &s.operand.expr {
            Expr::Ident(variable) => field(variable, &s.field),
            _ => None,
        },
        _ => None,
    }
}

fn field(variable: &str, name: &str) -> Option<Operand> {
    match variable {
        "payload" => Some(Operand::Payload(name.to_string())),
        "headers" => Some(Operand::Headers(name.to_string())),
        _ => None,
    }
}

fn literal(e: &Expression) -> Option<Literal> {
    let Expr::Literal(lit) = &e.expr else {
        return None;
    };
    Some(match lit {
        LiteralValue::Null => Literal::Null,
        LiteralValue::Boolean(b) => Literal::Bool(*b.inner()),
        LiteralValue::Int(i) => Literal::Int(*i.inner()),
        LiteralValue::Double(d) => Literal::Float(*d.inner()),
        LiteralValue::String(s) => Literal::Str(s.inner().to_string()),
        LiteralValue::Bytes(_) | LiteralValue::UInt(_) => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::filter::{EventContext, EventFields, Filter, Needs};
    use serde_json::json;

    /// SplitMix64: a seeded generator, so a failure reproduces.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'a>(&mut self, of: &[&'a str]) -> &'a str {
            of[self.below(of.len())]
        }
    }

    const OPERANDS: [&str; 10] = [
        "topic",
        "subject",
        "tenant",
        "raised_at",
        "payload.a",
        "payload.b",
        "payload.c",
        "payload.d",
        "headers.h",
        "headers.i",
    ];
    const LITERALS: [&str; 22] = [
        "null",
        "true",
        "false",
        "0",
        "1",
        "-1",
        "90",
        "9223372036854775807",
        "-9223372036854775808",
        "0.0",
        "1.0",
        "0.5",
        "90.5",
        "-1.5",
        "1e19",
        "\"\"",
        "\"a\"",
        "\"acme\"",
        "\"orders.created\"",
        "\"ü\"",
        "\"2026-12-07T10:00:00+00:00\"",
        "\"1\"",
    ];
    const OPERATORS: [&str; 6] = ["==", "!=", "<", "<=", ">", ">="];
    /// JSON values a field may hold, as text (numbers parsed as the event's would be).
    const VALUES: [&str; 24] = [
        "null",
        "true",
        "false",
        "0",
        "1",
        "-1",
        "90",
        "91",
        "9223372036854775807",
        "18446744073709551615",
        "100000000000000000000000000000",
        "1.0",
        "0.5",
        "90.5",
        "-0.0",
        "\"\"",
        "\"a\"",
        "\"acme\"",
        "\"ü\"",
        "\"1\"",
        "[]",
        "[1, \"a\"]",
        "{}",
        "{\"a\": 1}",
    ];

    fn expression(rng: &mut Rng, depth: usize) -> String {
        let leaf = depth == 0 || rng.below(3) == 0;
        if leaf {
            return match rng.below(10) {
                0 => format!("has({})", rng.pick(&OPERANDS[4..])),
                1 => {
                    let n = rng.below(4);
                    let items: Vec<&str> = (0..n).map(|_| rng.pick(&LITERALS)).collect();
                    format!("{} in [{}]", rng.pick(&OPERANDS), items.join(", "))
                }
                2 => rng.pick(&OPERANDS).to_string(),
                3 => rng.pick(&["true", "false"]).to_string(),
                4 => format!(
                    "{} {} {}",
                    rng.pick(&LITERALS),
                    rng.pick(&OPERATORS),
                    rng.pick(&OPERANDS)
                ),
                _ => format!(
                    "{} {} {}",
                    rng.pick(&OPERANDS),
                    rng.pick(&OPERATORS),
                    rng.pick(&LITERALS)
                ),
            };
        }
        match rng.below(4) {
            0 => format!("!({})", expression(rng, depth - 1)),
            1 => format!(
                "({}) || ({})",
                expression(rng, depth - 1),
                expression(rng, depth - 1)
            ),
            _ => format!(
                "({}) && ({})",
                expression(rng, depth - 1),
                expression(rng, depth - 1)
            ),
        }
    }

    fn object(rng: &mut Rng, keys: &[&str]) -> serde_json::Value {
        let mut fields = Vec::new();
        for k in keys {
            if rng.below(10) < 7 {
                fields.push(format!("\"{k}\": {}", rng.pick(&VALUES)));
            }
        }
        serde_json::from_str(&format!("{{{}}}", fields.join(", "))).expect("JSON")
    }

    fn lookup<'a>(event: &EventFields<'a>, o: &Operand) -> Scalar<'a> {
        let text = |s: Option<&'a str>| s.map_or(Scalar::Null, Scalar::string);
        let field = |v: &'a serde_json::Value, k: &str| match v {
            serde_json::Value::Object(o) => o.get(k).map_or(Scalar::Absent, Scalar::of_json),
            _ => Scalar::Other,
        };
        match o {
            Operand::Topic => Scalar::string(event.topic),
            Operand::Subject => text(event.subject),
            Operand::Tenant => text(event.tenant),
            Operand::RaisedAt => Scalar::string(event.raised_at),
            Operand::Payload(k) => field(event.payload, k),
            Operand::Headers(k) => field(event.headers, k),
        }
    }

    /// What fan-out's CEL path gives: a context of what the filter reads, of payload and headers
    /// only the fields it selects by name (as fan-out reads them).
    fn cel(filter: &Filter, event: &EventFields<'_>) -> Result<bool, String> {
        let needs = Needs::of([filter]);
        let selected = |v: &serde_json::Value, fields: Option<&[String]>| match (v, fields) {
            (serde_json::Value::Object(o), Some(fields)) => serde_json::Value::Object(
                fields
                    .iter()
                    .filter_map(|k| Some((k.clone(), o.get(k)?.clone())))
                    .collect(),
            ),
            _ => v.clone(),
        };
        let payload = selected(event.payload, needs.payload_fields());
        let headers = selected(event.headers, needs.headers_fields());
        let event = EventFields {
            payload: &payload,
            headers: &headers,
            ..event.clone()
        };
        filter.matches_in(&EventContext::for_needs(&event, &needs))
    }

    #[test]
    fn every_native_verdict_is_cels() {
        let mut rng = Rng(20261207);
        let (mut filters, mut native, mut verdicts, mut pairs) = (0, 0, 0, 0);
        let mut kinds = [0usize; 3];
        let mut plain = 0;
        for _ in 0..4000 {
            let source = expression(&mut rng, 3);
            let filter = Filter::compile(&source).unwrap_or_else(|e| panic!("{source}: {e:?}"));
            filters += 1;
            if !filter.is_native() {
                continue;
            }
            native += 1;
            for _ in 0..40 {
                let payload = object(&mut rng, &["a", "b", "c", "d"]);
                let headers = object(&mut rng, &["h", "i"]);
                let texts = ["", "a", "acme", "orders.created", "ü", "1"];
                let (subject, tenant) = (rng.pick(&texts), rng.pick(&texts));
                let event = EventFields {
                    topic: rng.pick(&["orders.created", "a", ""]),
                    subject: (rng.below(4) > 0).then_some(subject),
                    tenant: (rng.below(4) > 0).then_some(tenant),
                    payload: &payload,
                    headers: &headers,
                    raised_at: "2026-12-07T10:00:00+00:00",
                };
                pairs += 1;
                let expected = cel(&filter, &event);
                let got = filter.native_verdict(&mut |o| lookup(&event, o));
                if let Some(got) = got {
                    verdicts += 1;
                    assert_eq!(
                        expected,
                        Ok(got),
                        "{source} on {event:?}: CEL {expected:?}, native {got}"
                    );
                }
                // Of an event whose fields the filter reads are all scalars, CEL's every verdict.
                let scalars = filter.native.as_ref().expect("native").fields.iter();
                if scalars.clone().all(|f| lookup(&event, f) != Scalar::Other) && expected.is_ok() {
                    plain += 1;
                    assert!(
                        got.is_some(),
                        "{source} on {event:?}: CEL {expected:?}, native none"
                    );
                }
                kinds[match expected {
                    Ok(false) => 0,
                    Ok(true) => 1,
                    Err(_) => 2,
                }] += 1;
            }
        }
        // The generator reaches every outcome, and the native evaluator decides most events.
        assert!(kinds.iter().all(|&k| k > pairs / 20), "{kinds:?}");
        assert!(native * 10 >= filters * 9, "{native} of {filters} native");
        assert!(
            plain * 2 > kinds[0] + kinds[1],
            "{plain} plain of {kinds:?}"
        );
        assert!(verdicts >= plain, "{verdicts} verdicts, {plain} plain");
    }

    #[test]
    fn the_common_filters_are_native_and_decided() {
        let payload = json!({"amount": 95, "currency": "EUR", "vip": true, "n": null});
        let headers = json!({"source": "web"});
        let event = EventFields {
            topic: "orders.created",
            subject: Some("order-1"),
            tenant: Some("acme"),
            payload: &payload,
            headers: &headers,
            raised_at: "2026-12-07T10:00:00+00:00",
        };
        for (source, verdict) in [
            ("payload.amount > 90 && tenant == \"acme\"", true),
            ("payload.amount > 90.5", true),
            ("90 >= payload.amount", false),
            ("tenant in [\"acme\", \"globex\"]", true),
            ("has(payload.vip) && payload.vip", true),
            ("!has(payload.refund) || payload.refund > 0", true),
            ("payload.n == null && headers.source != \"api\"", true),
            (
                "topic == \"orders.created\" && subject == \"order-2\"",
                false,
            ),
            ("tenant == \"globex\" && payload.missing > 1", false),
            ("payload.amount > -1", true),
        ] {
            let filter = Filter::compile(source).expect(source);
            assert!(filter.is_native(), "{source}");
            assert_eq!(cel(&filter, &event), Ok(verdict), "{source}");
            assert_eq!(
                filter.native_verdict(&mut |o| lookup(&event, o)),
                Some(verdict),
                "{source}"
            );
        }
        // An error is CEL's to give (and to word): a missing field, a mismatch of kinds.
        for source in [
            "payload.missing > 1",
            "payload.currency > 1",
            "tenant == \"acme\" && payload.missing > 1",
            "payload.vip && payload.amount",
        ] {
            let filter = Filter::compile(source).expect(source);
            assert!(cel(&filter, &event).is_err(), "{source}");
            assert_eq!(filter.native_verdict(&mut |o| lookup(&event, o)), None);
        }
        // Everything else is CEL's alone.
        for source in [
            "payload.amount + 1 > 2",
            "size(payload.currency) == 3",
            "payload == {}",
            "payload.items.exists(i, i > 1)",
            "payload.customer.tier == \"gold\"",
            "payload[\"amount\"] > 1",
            "tenant.startsWith(\"ac\")",
            "payload.amount > 1u",
            // Text that looks like a macro binding payload: the fields are not known by name.
            "payload.a == \"exists(payload, x\"",
            "headers.h == \"all(headers, x\" && payload.a == 1",
        ] {
            let filter = Filter::compile(source).expect(source);
            assert!(!filter.is_native(), "{source}");
        }
    }

    #[test]
    fn an_event_too_large_for_cel_is_never_decided_natively() {
        let long = "x".repeat(2 << 20);
        let many: Vec<u32> = (0..200_000).collect();
        for payload in [json!({"s": long, "a": 1}), json!({"items": many, "a": 1})] {
            let event = EventFields {
                topic: "t",
                subject: None,
                tenant: Some("acme"),
                payload: &payload,
                headers: &serde_json::Value::Null,
                raised_at: "2026-12-07T10:00:00+00:00",
            };
            for source in [
                "tenant == \"globex\" && payload.s == \"x\"",
                "tenant == \"globex\" && has(payload.items)",
            ] {
                let filter = Filter::compile(source).expect(source);
                assert!(filter.is_native(), "{source}");
                let expected = cel(&filter, &event);
                if let Some(got) = filter.native_verdict(&mut |o| lookup(&event, o)) {
                    assert_eq!(expected, Ok(got), "{source}");
                }
            }
        }
        // Too large for CEL means no native verdict, even where the field is not reached.
        let payload = json!({"s": "x".repeat(2 << 20)});
        let event = EventFields {
            topic: "t",
            subject: None,
            tenant: Some("acme"),
            payload: &payload,
            headers: &serde_json::Value::Null,
            raised_at: "2026-12-07T10:00:00+00:00",
        };
        let filter = Filter::compile("tenant == \"globex\" && payload.s == \"x\"").unwrap();
        assert!(cel(&filter, &event).unwrap_err().contains("too large"));
        assert_eq!(filter.native_verdict(&mut |o| lookup(&event, o)), None);
    }
}
