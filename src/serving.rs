//! Where a pruned checkpoint runs, and the known limits of serving engines on its key width
//! K' (the README's "Serving" section names the upstream code behind each rule). The rules are data; [`notes`]
//! evaluates them for one model and width, and suggests the nearest width that avoids each.

use serde::Serialize;

const FLA: &[&str] = &["delta_net", "gated_deltanet"];
/// Gated DeltaNet layers of Qwen: the multimodal and text-only config shapes, dense and MoE.
const QWEN: &[&str] = &["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"];
/// Families whose layers run on fla's chunked kernels (transformers' Qwen classes use them when installed).
const FLA_KERNELS: &[&str] =
    &["delta_net", "gated_deltanet", "sse", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"];
/// Families whose recurrent layers are Mamba-2 mixers (llama.cpp runs them through GGML_OP_SSM_SCAN).
const MAMBA2: &[&str] = &["mamba2", "nemotron_h", "granitemoehybrid", "falcon_h1"];

/// What an engine needs of the key width K' (and the value width V).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "value")]
pub enum Need {
    /// K' ≤ n.
    AtMost(usize),
    /// K' a power of two.
    PowerOfTwo,
    /// K' = V: one head size for q, k and v.
    EqualsV,
    /// K' = n: kernels tiled for that width only.
    Exactly(usize),
    /// K' one of the widths a kernel is instantiated for.
    OneOf(&'static [usize]),
}

impl Need {
    pub fn holds(self, k: usize, v: usize) -> bool {
        match self {
            Need::AtMost(n) => k <= n,
            Need::PowerOfTwo => k.is_power_of_two(),
            Need::EqualsV => k == v,
            Need::Exactly(n) => k == n,
            Need::OneOf(ws) => ws.contains(&k),
        }
    }

    /// The widest width ≤ k that satisfies the need: pruning only narrows.
    fn widest_up_to(self, k: usize, v: usize) -> Option<usize> {
        let w = match self {
            Need::AtMost(n) => k.min(n),
            Need::PowerOfTwo => 1usize << k.max(1).ilog2(),
            Need::EqualsV => v,
            Need::Exactly(n) => n,
            Need::OneOf(ws) => ws.iter().copied().filter(|&w| w <= k).max().unwrap_or(0),
        };
        (w > 0 && w <= k).then_some(w)
    }

    fn broken(self, k: usize, v: usize) -> String {
        match self {
            Need::AtMost(n) => format!("K'={k} is above {n}"),
            Need::PowerOfTwo => format!("K'={k} is not a power of two"),
            Need::EqualsV => format!("K'={k} differs from V={v}"),
            Need::Exactly(n) => format!("K'={k} is not {n}"),
            Need::OneOf(ws) => {
                let ws: Vec<String> = ws.iter().map(|w| w.to_string()).collect();
                format!("K'={k} is not one of {}", ws.join(", "))
            }
        }
    }
}

/// One known limit.
pub struct Rule {
    /// `model_type`s it applies to.
    pub model_types: &'static [&'static str],
    pub engine: &'static str,
    pub need: Need,
    /// What the engine does with another width.
    pub why: &'static str,
    /// How to serve the checkpoint anyway, where a setting does it.
    pub workaround: Option<&'static str>,
}

pub static RULES: &[Rule] = &[
    Rule {
        model_types: FLA_KERNELS,
        engine: "fla",
        need: Need::AtMost(256),
        why: "fla's chunked kernels assert K <= 256 (fla/ops/common/chunk_delta_h.py)",
        workaround: None,
    },
    Rule {
        model_types: FLA,
        engine: "fla decode",
        need: Need::PowerOfTwo,
        why: "fla's fused recurrent (decode) kernel works on a key tile padded to the next power of two \
              (BK = next_power_of_2(K)); it runs, but decodes at the cost of the padded width",
        workaround: None,
    },
    Rule {
        model_types: &["qwen3_next"],
        engine: "vLLM",
        need: Need::PowerOfTwo,
        why: "vLLM's Qwen3-Next split kernel (fla/ops/fused_qkvzba_split_reshape.py) uses tl.arange(0, K'), \
              which Triton compiles only for powers of two",
        workaround: None,
    },
    Rule {
        model_types: QWEN,
        engine: "vLLM on Hopper",
        need: Need::EqualsV,
        why: "vLLM auto-selects FlashInfer's GDN prefill on SM90, which uses one head size for q, k and v",
        workaround: Some(r#"serve with --additional-config '{"gdn_prefill_backend": "triton"}'"#),
    },
    Rule {
        model_types: QWEN,
        engine: "FlashInfer/SGLang decode",
        need: Need::Exactly(128),
        why: "FlashInfer's GDN decode and SGLang's CuTe-DSL GDN decode are written around K = 128 tiles \
              (other widths untested: at best padded, at worst rejected)",
        workaround: Some("use the engine's Triton GDN decode where it offers one"),
    },
    Rule {
        model_types: QWEN,
        engine: "llama.cpp",
        need: Need::EqualsV,
        why: "llama.cpp's Qwen3.5 / Qwen3-Next loaders size the value heads from the GGUF's ssm.state_size, which \
              convert_hf_to_gguf.py writes from linear_key_head_dim (head_v_dim = ssm_d_state), and its delta-net \
              graph asserts S_k == S_v on a square state: the GGUF does not load (tensor has wrong shape)",
        workaround: None,
    },
    Rule {
        model_types: &["kimi_linear"],
        engine: "llama.cpp",
        need: Need::EqualsV,
        why: "llama.cpp's Kimi Linear graph uses one head size (n_embd_head_kda) for q, k and v and a square state, \
              so its GGUF cannot describe K' < V",
        workaround: None,
    },
    Rule {
        model_types: MAMBA2,
        engine: "llama.cpp CUDA",
        need: Need::OneOf(&[128, 256]),
        why: "llama.cpp's CUDA SSM_SCAN takes Mamba-2 only with d_state 128 or 256 (ggml-cuda.cu supports_op); \
              other widths run on the CPU op instead: it runs, but slower",
        workaround: None,
    },
];

/// Where each family's pruned checkpoint reloads.
pub static RUNS_IN: &[(&[&str], &str)] = &[
    (FLA, "flash-linear-attention (fla): transformers' AutoModelForCausalLM after `import fla`"),
    (
        QWEN,
        "transformers (its Qwen3.5 / Qwen3-Next classes, on fla's kernels when installed); vLLM and SGLang serve \
         the architecture, subject to the warnings",
    ),
    (&["mamba2"], "transformers (Mamba2ForCausalLM; 5.24+ for n_groups > 1); mamba_ssm inputs are written back as pytorch_model.bin"),
    (&["nemotron_h"], "transformers (NemotronHForCausalLM)"),
    (&["granitemoehybrid"], "transformers (GraniteMoeHybridForCausalLM)"),
    (&["falcon_h1"], "transformers (FalconH1ForCausalLM)"),
    (&["sse"], "scripts/sse_reference.py (fla tensor names; fla's own SSE layers not yet run)"),
];

/// A limit the chosen width hits.
#[derive(Debug, Clone, Serialize)]
pub struct Warning {
    pub engine: &'static str,
    pub need: Need,
    pub message: String,
    /// `--round-to` that gives the nearest width meeting the need, when one does.
    pub round_to: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Serving {
    pub runs_in: String,
    pub warnings: Vec<Warning>,
}

/// How to get width `w` from d_k `dk` when the plan gives `k`: `--round-to w` while k < 2w
/// (it rounds k down to w), else the ratio that leaves exactly w.
fn how_to_get(dk: usize, k: usize, w: usize) -> (String, Option<usize>) {
    if k < 2 * w {
        (format!("--round-to {w} gives {w}"), Some(w))
    } else {
        (format!("--ratio {} gives {w}", 1.0 - w as f64 / dk as f64), None)
    }
}

/// Serving notes for a `model_type` pruned from key width `dk` to `k`, with value width `v`.
pub fn notes(model_type: &str, dk: usize, k: usize, v: usize) -> Serving {
    let runs_in = RUNS_IN
        .iter()
        .find(|(types, _)| types.contains(&model_type))
        .map_or_else(|| format!("the {model_type} library the input came from"), |(_, s)| s.to_string());
    let mut warnings = Vec::new();
    for r in RULES.iter().filter(|r| r.model_types.contains(&model_type) && !r.need.holds(k, v)) {
        let mut message = format!("{}: {}: {}", r.engine, r.need.broken(k, v), r.why);
        let mut round_to = None;
        if let Some(w) = r.need.widest_up_to(k, v) {
            let (how, rt) = how_to_get(dk, k, w);
            message += &format!("; {how}, which {} accepts", r.engine);
            round_to = rt;
        }
        if let Some(fix) = r.workaround {
            message += &format!("; {fix}");
        }
        warnings.push(Warning { engine: r.engine, need: r.need, message, round_to });
    }
    Serving { runs_in, warnings }
}

impl Serving {
    /// Lines for the prune summary.
    pub fn lines(&self) -> Vec<String> {
        let mut out = vec![format!("runs in: {}", self.runs_in)];
        out.extend(self.warnings.iter().map(|w| format!("warning: {}", w.message)));
        out
    }

    pub fn markdown(&self) -> String {
        let mut s = format!("## Serving\n\nRuns in {}.\n\n", self.runs_in);
        if self.warnings.is_empty() {
            s += "No known engine limit is hit by this key width.\n\n";
        }
        for w in &self.warnings {
            s += &format!("- warning: {}\n", w.message);
        }
        if !self.warnings.is_empty() {
            s += "\n";
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engines(s: &Serving) -> Vec<&str> {
        s.warnings.iter().map(|w| w.engine).collect()
    }

    #[test]
    fn unpruned_widths_hit_nothing() {
        for mt in ["delta_net", "gated_deltanet", "qwen3_5", "qwen3_next", "mamba2", "nemotron_h", "sse", "kimi_linear"]
        {
            assert!(notes(mt, 128, 128, 128).warnings.is_empty(), "{mt}");
        }
        // fla's 1.3B GLA / Gated DeltaNet width.
        assert!(notes("gated_deltanet", 256, 256, 256).warnings.is_empty());
    }

    #[test]
    fn fla_width_limit_and_padding() {
        let s = notes("gated_deltanet", 512, 384, 512);
        assert_eq!(engines(&s), ["fla", "fla decode"]);
        assert!(s.warnings[0].message.contains("--round-to 256 gives 256"), "{}", s.warnings[0].message);
        assert_eq!(s.warnings[0].round_to, Some(256));
        // 640 >= 2 * 256: --round-to 256 would give 512, so the ratio is suggested.
        let s = notes("gated_deltanet", 1024, 640, 1024);
        assert!(s.warnings[0].message.contains("--ratio 0.75 gives 256"), "{}", s.warnings[0].message);
        assert_eq!(s.warnings[0].round_to, None);
        let s = notes("delta_net", 128, 96, 128);
        assert_eq!(engines(&s), ["fla decode"]);
        assert_eq!(s.warnings[0].round_to, Some(64));
        assert!(s.runs_in.contains("import fla"));
    }

    #[test]
    fn qwen3_next_power_of_two_and_prefill_backend() {
        let s = notes("qwen3_next", 128, 96, 128);
        assert_eq!(engines(&s), ["vLLM", "vLLM on Hopper", "FlashInfer/SGLang decode", "llama.cpp"]);
        let m = &s.warnings[0].message;
        assert!(
            m.contains("K'=96 is not a power of two") && m.contains("--round-to 64 gives 64, which vLLM accepts"),
            "{m}"
        );
        assert_eq!(s.warnings[0].round_to, Some(64));
        assert!(s.warnings[1].message.contains(r#"--additional-config '{"gdn_prefill_backend": "triton"}'"#));
        // No pruned width can equal V = 128 or the 128 tile: no suggestion, only the workaround.
        assert_eq!(s.warnings[1].round_to, None);
        assert!(!s.warnings[2].message.contains("--round-to"));
    }

    #[test]
    fn qwen3_5_power_of_two_width_needs_only_the_backends() {
        let s = notes("qwen3_5_text", 128, 64, 128);
        assert_eq!(engines(&s), ["vLLM on Hopper", "FlashInfer/SGLang decode", "llama.cpp"]);
        assert!(notes("qwen3_5", 128, 96, 128).warnings.iter().all(|w| w.engine != "vLLM"));
    }

    #[test]
    fn unknown_types_have_no_rules() {
        let s = notes("rwkv7", 64, 32, 64);
        assert!(s.warnings.is_empty() && s.runs_in.contains("rwkv7"));
    }

    #[test]
    fn llama_cpp_refuses_qwen_and_kimi_below_v() {
        for mt in QWEN.iter().chain(&["kimi_linear"]) {
            let s = notes(mt, 128, 96, 128);
            let w = s.warnings.iter().find(|w| w.engine == "llama.cpp").unwrap_or_else(|| panic!("{mt}"));
            assert_eq!(w.need, Need::EqualsV);
            // Pruning only narrows: no width reaches V, and there is no setting to suggest.
            assert!(
                w.message.contains("K'=96 differs from V=128") && !w.message.contains("--round-to"),
                "{}",
                w.message
            );
            assert_eq!(w.round_to, None);
            assert!(notes(mt, 128, 128, 128).warnings.iter().all(|w| w.engine != "llama.cpp"), "{mt}");
        }
        assert!(notes("qwen3_5", 128, 96, 128).warnings.iter().any(|w| w.message.contains("does not load")));
    }

    #[test]
    fn llama_cpp_cuda_scan_widths_for_mamba2_mixers() {
        for mt in MAMBA2 {
            for k in [128, 256] {
                assert!(notes(mt, 256, k, 64).warnings.is_empty(), "{mt} {k}");
            }
            let s = notes(mt, 128, 96, 64);
            assert_eq!(engines(&s), ["llama.cpp CUDA"], "{mt}");
            let m = &s.warnings[0].message;
            assert!(
                m.contains("K'=96 is not one of 128, 256") && m.contains("slower") && !m.contains("--round-to"),
                "{m}"
            );
        }
        // Falcon-H1's 256 pruned to 192: 128 is the widest kernel width below.
        let s = notes("falcon_h1", 256, 192, 64);
        assert!(s.warnings[0].message.contains("--round-to 128 gives 128, which llama.cpp CUDA accepts"));
        assert_eq!(s.warnings[0].round_to, Some(128));
        // 512 pruned to 300: 256, by rounding down.
        assert_eq!(notes("mamba2", 512, 300, 64).warnings[0].round_to, Some(256));
        // Other families never hit it.
        assert!(notes("gated_deltanet", 256, 96, 256).warnings.iter().all(|w| w.engine != "llama.cpp CUDA"));
    }

    #[test]
    fn one_of_serializes_its_widths() {
        let v = serde_json::to_value(Need::OneOf(&[128, 256])).unwrap();
        assert_eq!(v, serde_json::json!({"kind": "one_of", "value": [128, 256]}));
    }

    #[test]
    fn suggested_widths_meet_the_need() {
        for r in RULES {
            for k in 1..=600usize {
                for v in [64, 128, 256] {
                    if let Some(w) = r.need.widest_up_to(k, v) {
                        assert!(r.need.holds(w, v) && w <= k, "{:?} k {k} v {v} -> {w}", r.need);
                        if let (_, Some(rt)) = how_to_get(1024, k, w) {
                            assert_eq!(k / rt * rt, w, "{:?} k {k}", r.need);
                        }
                    }
                }
            }
        }
    }
}
