//! `statecut recover`'s training pass against PyTorch autograd: the embedded model pruned to half
//! its key width learns from the unpruned one under the recovery loss (cross-entropy plus T²·KL
//! at T = 2), and the loss and the gradient of every tensor of the default plan (q/k/v
//! projections, short convs, output norms, decay biases of every pruned mixer) must be
//! PyTorch's (`scripts/recover_grad_reference.py`, `tests/fixtures/grad/recover_gdn_moby`).

mod common;

use candle_core::{DType, Tensor, Var};
use statecut::arch::layered::Resident;
use statecut::arch::trainable::{Selector, Trainable};
use statecut::arch::{family_for, LoadOptions};
use statecut::checkpoint::Checkpoint;
use statecut::cli::Recompute;
use statecut::recover::loss::KdConfig;
use statecut::recover::plan::plan;
use statecut::recover::stages::Pass;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

/// ||statecut - PyTorch|| / ||PyTorch|| allowed for each gradient, as in `grad_parity`.
const GRAD_TOLERANCE: f64 = 1e-3;
/// Relative difference allowed for the loss: both sides sum the same float32 terms.
const LOSS_TOLERANCE: f64 = 1e-5;

/// The student the golden was made from: the embedded model pruned by L1 to half its key width.
fn prune(out: &Path) {
    let model = common::embedded_model();
    let args = ["prune", "-m", model.to_str().unwrap(), "--method", "l1", "--ratio", "0.5"];
    let (code, _, err) = common::statecut(&[&args[..], &["-o", out.to_str().unwrap(), "-q"]].concat(), &[]);
    assert_eq!(code, 0, "{err}");
}

/// The kind of a plan tensor, for the summary: its module under the mixer (`q_proj`, `o_norm`).
fn kind(name: &str) -> &str {
    let rest = name.split_once(".attn.").map_or(name, |(_, r)| r);
    rest.strip_suffix(".weight").unwrap_or(rest)
}

#[test]
fn recovery_loss_and_gradients_match_pytorch() {
    let reference = common::grad::reference("recover_gdn_moby");
    let tmp = tempfile::tempdir().unwrap();
    let student_dir = tmp.path().join("student");
    prune(&student_dir);

    let opts = LoadOptions::cpu_f32();
    let (t_ckpt, s_ckpt) =
        (Checkpoint::open(&common::embedded_model()).unwrap(), Checkpoint::open(&student_dir).unwrap());
    let family = family_for(&s_ckpt).unwrap();
    let layout = family.layout(&s_ckpt).unwrap();
    let plan = plan(&s_ckpt, &layout, "mixers").unwrap();
    // The golden was differentiated with respect to exactly the plan's tensors.
    let golden: BTreeSet<String> = reference.keys().filter_map(|k| k.strip_prefix("grad.")).map(String::from).collect();
    assert_eq!(plan.keys().cloned().collect::<BTreeSet<_>>(), golden, "the plan is not the golden's tensors");

    let teacher =
        Resident::load(family.layers(&t_ckpt, &opts, t_ckpt.var_builder(opts.dtype, &opts.device).unwrap()).unwrap())
            .unwrap();
    let set = Trainable::default();
    let names: Arc<BTreeSet<String>> = Arc::new(plan.keys().cloned().collect());
    let select: Selector = Arc::new(move |n: &str| names.contains(n));
    let weights = set.wrap(s_ckpt.var_builder(opts.dtype, &opts.device).unwrap(), select);
    let student = Resident::load(family.layers(&s_ckpt, &opts, weights).unwrap()).unwrap();
    let vars: Vec<(String, Var)> = set.vars().into_iter().collect();
    assert_eq!(vars.len(), golden.len(), "the student reads {} of the plan's {} tensors", vars.len(), golden.len());

    let ids = reference["ids"].to_dtype(DType::U32).unwrap();
    let (b, t) = ids.dims2().unwrap();
    let (inputs, targets) = (ids.narrow(1, 0, t - 1).unwrap(), ids.narrow(1, 1, t - 1).unwrap());
    let cfg = KdConfig { temperature: 2.0, kd_weight: 1.0, lm_weight: 1.0 };
    let mut acc: HashMap<String, Tensor> = HashMap::new();
    let tokens = b * (t - 1);
    let pass = Pass::new(&student, &teacher, &cfg, Recompute::All);
    let parts = pass.run(&inputs, &targets, 1.0 / tokens as f64, &vars, &mut acc).unwrap();

    let mut failures = Vec::new();
    let want = reference["loss"].to_vec1::<f64>().unwrap()[0];
    let loss = parts.loss(&cfg);
    let loss_err = (loss - want).abs() / want.abs();
    if parts.tokens != tokens || loss_err.is_nan() || loss_err > LOSS_TOLERANCE {
        failures.push(format!("loss {loss} over {} tokens vs PyTorch's {want} over {tokens}", parts.tokens));
    }
    let mut worst: BTreeMap<&str, (f64, &str)> = BTreeMap::new();
    for name in &golden {
        let Some(g) = acc.get(name) else {
            failures.push(format!("{name}: no gradient"));
            continue;
        };
        let got = common::grad::sampled(g, reference.get(&format!("rows.{name}")));
        let err = common::rel_err(&got, &common::flat(&reference[&format!("grad.{name}")]));
        if err.is_nan() || err > GRAD_TOLERANCE {
            failures.push(format!("{name}: relative error {err:.3e}"));
        }
        let w = worst.entry(kind(name)).or_insert((0.0, name));
        if err > w.0 {
            *w = (err, name);
        }
    }
    assert!(failures.is_empty(), "the recovery pass differs from PyTorch's:\n{}", failures.join("\n"));
    eprintln!("loss {loss:.6} vs PyTorch {want:.6} (relative {loss_err:.1e}); largest gradient error by kind:");
    for (k, (err, name)) in worst {
        eprintln!("  {k:9} {err:.2e} ({name})");
    }
}
