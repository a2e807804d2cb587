//! Writing an edited config.json as the input's own text with only the edited values replaced,
//! so that key order, number spelling (`1e-06`), indentation and escapes stay byte for byte.

use serde_json::Value;

/// `text` (which parses to `old`) with every scalar that differs in `new` replaced in place.
/// None when `new` changes the structure (keys added or removed, arrays resized, a container
/// replaced): the caller then writes `new` afresh.
pub fn splice(text: &str, old: &Value, new: &Value) -> Option<String> {
    let mut edits = Vec::new();
    let end = walk(text.as_bytes(), skip_ws(text.as_bytes(), 0), old, new, &mut edits)?;
    if skip_ws(text.as_bytes(), end) != text.len() {
        return None;
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (start, stop, value) in edits {
        out.push_str(&text[at..start]);
        out.push_str(&value);
        at = stop;
    }
    out.push_str(&text[at..]);
    Some(out)
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// End of the string starting at the quote `b[i]`.
fn string_end(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// End of the value starting at `b[i]` (any JSON value, or a bare `NaN` / `Infinity`).
fn value_end(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => string_end(b, i),
        open @ (b'{' | b'[') => {
            let close = if open == b'{' { b'}' } else { b']' };
            let mut j = skip_ws(b, i + 1);
            if b.get(j) == Some(&close) {
                return Some(j + 1);
            }
            loop {
                if open == b'{' {
                    j = string_end(b, j)?;
                    j = skip_ws(b, j);
                    (b.get(j) == Some(&b':')).then_some(())?;
                    j = skip_ws(b, j + 1);
                }
                j = skip_ws(b, value_end(b, j)?);
                match *b.get(j)? {
                    b',' => j = skip_ws(b, j + 1),
                    c if c == close => return Some(j + 1),
                    _ => return None,
                }
            }
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']') && !b[j].is_ascii_whitespace() {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// Walk the value at `b[i]` (parsed as `old`) against `new`, recording scalar replacements.
fn walk(b: &[u8], i: usize, old: &Value, new: &Value, edits: &mut Vec<(usize, usize, String)>) -> Option<usize> {
    if old == new {
        return value_end(b, i);
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            if o.len() != n.len() || o.keys().any(|k| !n.contains_key(k)) {
                return None;
            }
            (b.get(i) == Some(&b'{')).then_some(())?;
            let mut j = skip_ws(b, i + 1);
            loop {
                let key_end = string_end(b, j)?;
                let key: String = serde_json::from_slice(&b[j..key_end]).ok()?;
                j = skip_ws(b, key_end);
                (b.get(j) == Some(&b':')).then_some(())?;
                j = skip_ws(b, j + 1);
                j = skip_ws(b, walk(b, j, o.get(&key)?, n.get(&key)?, edits)?);
                match *b.get(j)? {
                    b',' => j = skip_ws(b, j + 1),
                    b'}' => return Some(j + 1),
                    _ => return None,
                }
            }
        }
        (Value::Array(o), Value::Array(n)) if o.len() == n.len() => {
            (b.get(i) == Some(&b'[')).then_some(())?;
            let mut j = skip_ws(b, i + 1);
            for (k, (x, y)) in o.iter().zip(n).enumerate() {
                j = skip_ws(b, walk(b, j, x, y, edits)?);
                let sep = if k + 1 == o.len() { b']' } else { b',' };
                (b.get(j) == Some(&sep)).then_some(())?;
                j = skip_ws(b, j + 1);
            }
            Some(j)
        }
        (o, n) if !o.is_object() && !o.is_array() && !n.is_object() && !n.is_array() => {
            let end = value_end(b, i)?;
            edits.push((i, end, serde_json::to_string(n).ok()?));
            Some(end)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"{
    "model_type": "qwen3_5",
    "text_config": {
        "rms_norm_eps": 1e-06,
        "linear_key_head_dim": 128,
        "layer_types": ["linear_attention", "full_attention"],
        "name": "caf\u00e9",
        "rope_parameters": {"rope_theta": 10000000, "mrope_section": [11, 11, 10]},
        "limit": Infinity
    },
    "architectures": ["Qwen3_5ForConditionalGeneration"]
}
"#;

    fn parse(t: &str) -> Value {
        crate::checkpoint::parse_config(t).unwrap()
    }

    #[test]
    fn replaces_only_the_edited_value() {
        let old = parse(TEXT);
        let mut new = old.clone();
        new["text_config"]["linear_key_head_dim"] = Value::from(64);
        let out = splice(TEXT, &old, &new).unwrap();
        assert_eq!(out, TEXT.replace("\"linear_key_head_dim\": 128", "\"linear_key_head_dim\": 64"));
        assert_eq!(splice(TEXT, &old, &old).unwrap(), TEXT);
        new["text_config"]["rope_parameters"]["mrope_section"][2] = Value::from(9);
        assert!(splice(TEXT, &old, &new).unwrap().contains("[11, 11, 9]"));
    }

    #[test]
    fn structural_changes_are_left_to_the_caller() {
        let old = parse(TEXT);
        let mut new = old.clone();
        new["text_config"]["extra"] = Value::from(1);
        assert!(splice(TEXT, &old, &new).is_none());
        let mut new = old.clone();
        new["architectures"] = Value::Array(vec![]);
        assert!(splice(TEXT, &old, &new).is_none());
        assert!(splice("{\"a\": 1} x", &parse("{\"a\": 1}"), &parse("{\"a\": 2}")).is_none());
    }

    /// The fallback writes keys in the input's order too (serde_json's `preserve_order`).
    #[test]
    fn values_keep_the_key_order() {
        let keys: Vec<String> = parse(TEXT)["text_config"].as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["rms_norm_eps", "linear_key_head_dim", "layer_types", "name", "rope_parameters", "limit"]);
    }
}
