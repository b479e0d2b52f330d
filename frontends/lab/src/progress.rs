//! Progress while the lab runs: which experiment, which point, how many
//! are left and an ETA. On a terminal it is an indicatif bar on stderr;
//! otherwise (CI logs, pipes) one plain line per point, so a log still
//! shows where a long run is.
//!
//! Every measured run goes through `common::run_stack_inspect`, which
//! calls [`tick`]; an experiment that knows its number of runs up front
//! says so with [`expect_runs`] so the bar has a length and an ETA.
//! Outside a `lab` command (unit tests) nothing is shown.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;

struct State {
    experiment: String,
    bar: Option<ProgressBar>,
    done: u64,
    total: Option<u64>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with_state(f: impl FnOnce(&mut State)) {
    if let Ok(mut g) = STATE.lock() {
        if let Some(s) = g.as_mut() {
            f(s);
        }
    }
}

/// Start showing progress for `experiment`.
pub fn begin(experiment: &str) {
    let bar = std::io::stderr().is_terminal().then(|| {
        let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        b.set_style(
            ProgressStyle::with_template(
                "{prefix:>12} [{bar:28}] {pos}/{len} runs  ETA {eta}  {wide_msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        b.set_prefix(experiment.to_string());
        b
    });
    if let Ok(mut g) = STATE.lock() {
        *g = Some(State {
            experiment: experiment.to_string(),
            bar,
            done: 0,
            total: None,
        });
    }
}

/// The experiment will make `n` measured runs (more calls add up).
pub fn expect_runs(n: u64) {
    with_state(|s| {
        let total = s.total.unwrap_or(0) + n;
        s.total = Some(total);
        if let Some(b) = &s.bar {
            b.set_length(total);
        }
    });
}

/// One measured run is starting; `point` says which (first table line).
pub fn tick(point: &str) {
    with_state(|s| {
        s.done += 1;
        let point = point.trim();
        match &s.bar {
            Some(b) => {
                b.set_position(s.done - 1);
                b.set_message(point.to_string());
            }
            None => {
                let of = s.total.map(|t| format!("/{t}")).unwrap_or_default();
                eprintln!("lab {}: run {}{of}: {point}", s.experiment, s.done);
            }
        }
    });
}

/// [`tick`] for a run on a stack file: the device under test (`dev`,
/// usually the last line) names the point.
pub fn tick_stack(stack: &str) {
    let point = stack
        .lines()
        .find(|l| l.starts_with("dev:"))
        .or_else(|| stack.lines().last())
        .unwrap_or(stack);
    tick(point);
}

/// Stop showing progress (the bar is cleared; its text follows).
pub fn finish() {
    if let Ok(mut g) = STATE.lock() {
        if let Some(s) = g.take() {
            if let Some(b) = s.bar {
                b.finish_and_clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_runs_and_stops() {
        begin("demo");
        expect_runs(3);
        expect_runs(2);
        tick("dev: 0 8 zero");
        let (done, total) = STATE
            .lock()
            .unwrap()
            .as_ref()
            .map(|s| (s.done, s.total))
            .unwrap();
        assert_eq!((done, total), (1, Some(5)));
        finish();
        assert!(STATE.lock().unwrap().is_none());
        tick("ignored after finish");
        assert!(STATE.lock().unwrap().is_none());
    }
}
