//! The work one filter evaluation may do, enforced while it runs.
//!
//! The workers evaluate tenants' CEL filters, and CEL has comprehensions: a 404-byte filter of
//! nested `L.map(...)` made a worker abort on allocation failure (the postmaster restarted the
//! cluster, and the filter ran again after the restart), and `L.all(a, L.all(b, ...))` took 25 s
//! per event with cancel and terminate ignored (issue #10). The interpreter has no hook for a
//! budget, so the compiled filter is rewritten before it runs:
//! - every comprehension's range and every iteration of its loop first calls `__budget()`, which
//!   counts a step and, every few hundred steps, asks whether the process has an interrupt
//!   pending (cancel, terminate): over `STEPS` steps, or interrupted, the evaluation ends with an
//!   error, which the caller counts as a predicate error;
//! - everything that builds a value from other values (`+`, list and map literals, the elements a
//!   `map` collects) is measured by `__measure(x)` once built: more than `BYTES` built in one
//!   evaluation ends it the same way. Values are measured right after they are built, so the most
//!   one evaluation can hold is about twice the budget plus the event itself.
//!
//! The loop shapes the interpreter optimises (`@result + [x]` for map and filter, `@result && x`
//! for all and exists) keep their shape: the calls go inside them.

use cel::common::ast::{operators, CallExpr, EntryExpr, Expr, IdedExpr, ListExpr, LiteralValue};
use cel::common::types::{CelBool, CelBytes, CelList, CelMap, CelMapKey, CelOptional, CelString};
use cel::common::value::{CowVal, Val};
use cel::objects::Value;
use cel::{Env, ExecutionError};
use std::cell::Cell;

/// Steps (comprehension iterations and ranges) one evaluation may take: a hundred thousand
/// iterations of a small loop body take a few tens of milliseconds.
pub const STEPS: u64 = 100_000;
/// Bytes one evaluation may build (strings, lists and maps it creates).
pub const BYTES: u64 = 16 << 20;
/// How long one evaluation may take, whatever its steps do (a step may scan a list with `in`).
pub const DEADLINE: std::time::Duration = std::time::Duration::from_millis(250);
/// How often (in steps) the interrupt probe is asked.
const PROBE_EVERY: u64 = 256;

const BUDGET_FN: &str = "__budget";
const MEASURE_FN: &str = "__measure";

/// Names a filter may not call itself: the hooks above.
pub fn is_reserved(function: &str) -> bool {
    function.starts_with("__")
}

thread_local! {
    static STEPS_LEFT: Cell<u64> = const { Cell::new(STEPS) };
    static BYTES_LEFT: Cell<u64> = const { Cell::new(BYTES) };
    static INTERRUPTED: Cell<bool> = const { Cell::new(false) };
    static STARTED: Cell<Option<std::time::Instant>> = const { Cell::new(None) };
    static PROBE: Cell<Option<fn() -> bool>> = const { Cell::new(None) };
}

/// Tells evaluations in this thread how to see that the process should stop (PostgreSQL's
/// `InterruptPending`); without one, only the step budget ends a long evaluation.
pub fn set_interrupt_probe(probe: fn() -> bool) {
    PROBE.with(|p| p.set(Some(probe)));
}

/// Resets the budget for one evaluation.
pub(crate) fn start() {
    STEPS_LEFT.with(|s| s.set(STEPS));
    BYTES_LEFT.with(|b| b.set(BYTES));
    INTERRUPTED.with(|i| i.set(false));
    STARTED.with(|t| t.set(Some(std::time::Instant::now())));
}

fn past_deadline() -> Result<(), ExecutionError> {
    if STARTED
        .with(|t| t.get())
        .is_some_and(|t| t.elapsed() > DEADLINE)
    {
        return Err(error(format!(
            "the filter ran longer than {} ms on this event",
            DEADLINE.as_millis()
        )));
    }
    Ok(())
}

/// Whether the last evaluation in this thread stopped for an interrupt (the caller should
/// process it now).
pub fn interrupted() -> bool {
    INTERRUPTED.with(|i| i.get())
}

fn error(message: impl ToString) -> ExecutionError {
    ExecutionError::function_error("filter budget", message)
}

fn step() -> Result<(), ExecutionError> {
    let left = STEPS_LEFT.with(|s| {
        let left = s.get();
        s.set(left.saturating_sub(1));
        left
    });
    if left == 0 {
        return Err(error(format!(
            "the filter took more than {STEPS} steps on this event"
        )));
    }
    if left.is_multiple_of(PROBE_EVERY) && PROBE.with(|p| p.get()).is_some_and(|probe| probe()) {
        INTERRUPTED.with(|i| i.set(true));
        return Err(error("evaluation interrupted"));
    }
    past_deadline()
}

/// Bytes a value holds, counting what it contains (a list of strings holds the strings).
fn size(v: &dyn Val) -> u64 {
    if let Some(s) = v.downcast_ref::<CelString>() {
        return s.inner().len() as u64 + 16;
    }
    if let Some(b) = v.downcast_ref::<CelBytes>() {
        return b.inner().len() as u64 + 16;
    }
    if let Some(list) = v.downcast_ref::<CelList>() {
        return 16 + list.inner().iter().map(|e| size(e.as_ref())).sum::<u64>();
    }
    if let Some(map) = v.downcast_ref::<CelMap>() {
        return 16
            + map
                .inner()
                .iter()
                .map(|(k, e)| {
                    let key = match k {
                        CelMapKey::String(s) => s.inner().len() as u64,
                        _ => 8,
                    };
                    32 + key + size(e.as_ref())
                })
                .sum::<u64>();
    }
    if let Some(o) = v.downcast_ref::<CelOptional>() {
        return 16 + o.inner().map_or(0, size);
    }
    16
}

fn measure(v: &dyn Val) -> Result<(), ExecutionError> {
    let n = size(v);
    let left = BYTES_LEFT.with(|b| {
        let left = b.get();
        b.set(left.saturating_sub(n));
        left
    });
    if n > left {
        return Err(error(format!(
            "the filter built more than {} MB on this event",
            BYTES >> 20
        )));
    }
    past_deadline()
}

fn budget_hook<'b, 'v>(_args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    step()?;
    Ok(CowVal::owned(CelBool::from(true)))
}

fn measure_hook<'b, 'v>(mut args: Vec<CowVal<'b, 'v>>) -> Result<CowVal<'b, 'v>, ExecutionError> {
    let value = args.pop().ok_or_else(|| error("one argument expected"))?;
    measure(value.as_ref())?;
    Ok(value)
}

/// Adds the two hooks to an environment (once per thread: see filter::ENV).
pub(crate) fn install(env: &mut Env) {
    env.add_overload(BUDGET_FN, BUDGET_FN, vec![], budget_hook)
        .expect("a fresh environment has no __budget");
    env.add_overload(
        MEASURE_FN,
        MEASURE_FN,
        vec![cel::common::types::DYN_TYPE],
        measure_hook,
    )
    .expect("a fresh environment has no __measure");
}

fn node(expr: Expr) -> IdedExpr {
    // Ids only matter for error positions; the hooks have none in the source.
    IdedExpr { id: 0, expr }
}

fn call(name: &str, args: Vec<IdedExpr>) -> IdedExpr {
    node(Expr::Call(CallExpr {
        func_name: name.to_string(),
        target: None,
        args,
    }))
}

/// `__budget() ? x : null`: the step is counted before `x` is evaluated (the conditional's
/// condition is; a function's arguments are evaluated before the call).
fn counted(x: IdedExpr) -> IdedExpr {
    call(
        operators::CONDITIONAL,
        vec![
            call(BUDGET_FN, vec![]),
            x,
            node(Expr::Literal(LiteralValue::Null)),
        ],
    )
}

fn measured(x: IdedExpr) -> IdedExpr {
    call(MEASURE_FN, vec![x])
}

fn is_ident(e: &IdedExpr, name: &str) -> bool {
    matches!(&e.expr, Expr::Ident(n) if n == name)
}

/// The filter's expression with the hooks in place.
pub(crate) fn instrument(e: &IdedExpr) -> IdedExpr {
    let mut out = e.clone();
    rewrite(&mut out);
    out
}

fn rewrite(e: &mut IdedExpr) {
    match &mut e.expr {
        Expr::Call(c) => {
            if let Some(t) = c.target.as_deref_mut() {
                rewrite(t);
            }
            c.args.iter_mut().for_each(rewrite);
            if c.func_name == operators::ADD && c.target.is_none() {
                *e = measured(std::mem::take(e));
            }
        }
        Expr::List(list) => {
            list.elements.iter_mut().for_each(rewrite);
            *e = measured(std::mem::take(e));
        }
        Expr::Map(map) => {
            for entry in &mut map.entries {
                if let EntryExpr::MapEntry(m) = &mut entry.expr {
                    rewrite(&mut m.key);
                    rewrite(&mut m.value);
                }
            }
            *e = measured(std::mem::take(e));
        }
        Expr::Struct(st) => {
            for entry in &mut st.entries {
                if let EntryExpr::StructField(f) = &mut entry.expr {
                    rewrite(&mut f.value);
                }
            }
        }
        Expr::Select(select) => rewrite(&mut select.operand),
        Expr::Comprehension(c) => {
            let accu = c.accu_var.clone();
            rewrite(&mut c.accu_init);
            rewrite(&mut c.loop_cond);
            rewrite(&mut c.result);
            let range = std::mem::take(&mut c.iter_range);
            c.iter_range = counted({
                let mut r = range;
                rewrite(&mut r);
                r
            });
            rewrite_step(&mut c.loop_step, &accu);
        }
        Expr::Unspecified | Expr::Ident(_) | Expr::Literal(_) => {}
    }
}

/// The loop step, keeping the shapes the interpreter recognises (see the module comment).
fn rewrite_step(step: &mut IdedExpr, accu: &str) {
    if let Expr::Call(c) = &mut step.expr {
        let binary = c.target.is_none() && c.args.len() == 2;
        // all / exists: @result && x, @result || x
        if binary
            && (c.func_name == operators::LOGICAL_AND || c.func_name == operators::LOGICAL_OR)
            && is_ident(&c.args[0], accu)
        {
            let x = &mut c.args[1];
            rewrite(x);
            *x = counted(std::mem::take(x));
            return;
        }
        // map: @result + [x]
        if binary && c.func_name == operators::ADD && is_ident(&c.args[0], accu) {
            if let Expr::List(ListExpr { elements, .. }) = &mut c.args[1].expr {
                for x in elements.iter_mut() {
                    rewrite(x);
                    *x = measured(counted(std::mem::take(x)));
                }
                return;
            }
        }
        // filter: cond ? @result + [x] : @result (and exists_one: cond ? @result + 1 : @result)
        if c.func_name == operators::CONDITIONAL
            && c.target.is_none()
            && c.args.len() == 3
            && is_ident(&c.args[2], accu)
        {
            let cond = &mut c.args[0];
            rewrite(cond);
            *cond = counted(std::mem::take(cond));
            if let Expr::Call(then) = &mut c.args[1].expr {
                if then.func_name == operators::ADD && then.args.len() == 2 {
                    if let Expr::List(ListExpr { elements, .. }) = &mut then.args[1].expr {
                        for x in elements.iter_mut() {
                            rewrite(x);
                            *x = measured(std::mem::take(x));
                        }
                    } else {
                        rewrite(&mut then.args[1]);
                    }
                    return;
                }
            }
            rewrite(&mut c.args[1]);
            return;
        }
    }
    rewrite(step);
    *step = counted(std::mem::take(step));
}

/// Evaluates an instrumented expression within the budget.
pub(crate) fn evaluate(expr: &IdedExpr, context: &cel::Context<'_, '_>) -> Result<Value, String> {
    start();
    Value::resolve(expr, context).map_err(|e| e.to_string())
}
