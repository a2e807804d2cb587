//! config.json into the families' `#[derive(Deserialize)]` structs, every error naming its key.
//!
//! serde_json's own errors say "invalid type: string \"yes\", expected a boolean" without the
//! key; [`from_value`] walks the objects itself so that the message reads
//! `config key use_conv_bias: invalid type: ...` (nested keys as `ssm_cfg.conv_bias`). A key
//! set to null reads as absent (its default), as transformers reads it.

use serde::de::{self, DeserializeOwned, IntoDeserializer, Visitor};
use serde::Deserialize;
use serde_json::{Error, Value};

/// Deserialize `value` (an object) into `T`, naming the key of a value of the wrong type.
pub fn from_value<T: DeserializeOwned>(value: &Value) -> Result<T, Error> {
    from_value_at(value, "")
}

/// [`from_value`] for the object at `path` of config.json (`text_config`), its keys named from there.
pub fn from_value_at<T: DeserializeOwned>(value: &Value, path: &str) -> Result<T, Error> {
    T::deserialize(Keyed { key: path.to_string(), value: value.clone() })
}

/// One config value with the path of keys that led to it.
struct Keyed {
    key: String,
    value: Value,
}

/// An object's entries; a value's error names its key (nested values name their own, longer one).
struct Entries {
    prefix: String,
    iter: serde_json::map::IntoIter,
    pending: Option<(String, Value)>,
}

impl<'de> de::MapAccess<'de> for Entries {
    type Error = Error;

    fn next_key_seed<K: de::DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, Error> {
        // null is transformers' "not set": the field's default applies, as when it is absent
        let Some((k, v)) = self.iter.find(|(_, v)| !v.is_null()) else { return Ok(None) };
        let path = if self.prefix.is_empty() { k.clone() } else { format!("{}.{k}", self.prefix) };
        self.pending = Some((path, v));
        seed.deserialize(IntoDeserializer::<'de, Error>::into_deserializer(k)).map(Some)
    }

    fn next_value_seed<S: de::DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, Error> {
        let (key, value) = self.pending.take().ok_or_else(|| de::Error::custom("value without a key"))?;
        seed.deserialize(Keyed { key: key.clone(), value }).map_err(|e| {
            let msg = e.to_string();
            if msg.starts_with("config key ") {
                e
            } else {
                de::Error::custom(format!("config key {key}: {msg}"))
            }
        })
    }
}

macro_rules! forward {
    ($($method:ident),*) => {$(
        fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
            self.value.$method(visitor)
        }
    )*};
}

impl<'de> de::Deserializer<'de> for Keyed {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.value {
            Value::Object(map) => visitor.visit_map(Entries { prefix: self.key, iter: map.into_iter(), pending: None }),
            v => v.deserialize_any(visitor),
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self.value {
            Value::Null => visitor.visit_none(),
            _ => visitor.visit_some(self),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }

    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _name: &'static str, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.value.deserialize_enum(name, variants, visitor)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, Error> {
        self.value.deserialize_unit_struct(name, visitor)
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, Error> {
        self.value.deserialize_tuple(len, visitor)
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.value.deserialize_tuple_struct(name, len, visitor)
    }

    forward!(
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_unit,
        deserialize_seq,
        deserialize_identifier,
        deserialize_ignored_any
    );
}

/// A float that Python may have written as `Infinity`, `"inf"` or `{"__float__": "Infinity"}`.
pub fn float_of(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "infinity" | "inf" | "+infinity" | "+inf" => Some(f64::INFINITY),
            "-infinity" | "-inf" => Some(f64::NEG_INFINITY),
            "nan" => Some(f64::NAN),
            s => s.parse().ok(),
        },
        Value::Object(o) => o.get("__float__").and_then(float_of),
        _ => None,
    }
}

/// `time_step_limit` / `dt_limit`: a (min, max) pair, (0, inf) when absent or null.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limit(pub f64, pub f64);

impl Default for Limit {
    fn default() -> Self {
        Limit(0.0, f64::INFINITY)
    }
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        match &v {
            Value::Null => Ok(Limit::default()),
            Value::Array(a) if a.len() == 2 => match (float_of(&a[0]), float_of(&a[1])) {
                (Some(lo), Some(hi)) => Ok(Limit(lo, hi)),
                _ => Err(de::Error::custom(format!("time step limit {v} is not a pair of numbers"))),
            },
            _ => Err(de::Error::custom(format!("time step limit {v} is not a pair of numbers"))),
        }
    }
}

/// A size that configs may also give as "auto" (`mamba_d_head`): None then.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AutoSize(pub Option<usize>);

impl<'de> Deserialize<'de> for AutoSize {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::String(s) if s == "auto" => Ok(AutoSize(None)),
            v => usize::deserialize(v).map(|n| AutoSize(Some(n))).map_err(de::Error::custom),
        }
    }
}

/// transformers 5's `rope_parameters` (older configs keep `rope_theta` at the top level).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
}

/// RoPE theta from `rope_parameters`, else the top-level key, else `default`.
pub fn rope_theta(params: Option<&RopeParameters>, top: Option<f64>, default: f64) -> f64 {
    params.and_then(|r| r.rope_theta).or(top).unwrap_or(default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        #[serde(default)]
        conv_bias: bool,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Outer {
        hidden_size: usize,
        #[serde(default, alias = "eps")]
        rms_norm_eps: Option<f64>,
        #[serde(default)]
        ssm_cfg: Option<Inner>,
        #[serde(default)]
        limit: Limit,
        #[serde(default)]
        layers: Vec<usize>,
    }

    fn err(v: Value) -> String {
        from_value::<Outer>(&v).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_key() {
        let e = err(json!({"hidden_size": "64"}));
        assert!(e.starts_with("config key hidden_size: invalid type: string \"64\""), "{e}");
        let e = err(json!({"hidden_size": 64, "rms_norm_eps": "1e-6"}));
        assert!(e.starts_with("config key rms_norm_eps: "), "{e}");
        let e = err(json!({"hidden_size": 64, "ssm_cfg": {"conv_bias": "yes"}}));
        assert!(e.starts_with("config key ssm_cfg.conv_bias: invalid type: string \"yes\""), "{e}");
        let e = err(json!({"hidden_size": 64, "layers": [1, "2"]}));
        assert!(e.starts_with("config key layers: "), "{e}");
        let e = err(json!({"hidden_size": 64, "limit": [0, "x"]}));
        assert!(e.starts_with("config key limit: time step limit"), "{e}");
        assert!(err(json!({})).contains("missing field `hidden_size`"));
    }

    #[test]
    fn reads_what_serde_json_reads() {
        let v = json!({"hidden_size": 64, "eps": 1e-5, "ssm_cfg": null, "limit": [0.0, "Infinity"],
                       "layers": [1, 2], "unknown": {"a": [1]}});
        let o: Outer = from_value(&v).unwrap();
        assert_eq!((o.hidden_size, o.rms_norm_eps, o.limit), (64, Some(1e-5), Limit(0.0, f64::INFINITY)));
        assert!(o.ssm_cfg.is_none());
        assert_eq!(o.layers, [1, 2]);
        let o: Outer = from_value(&json!({"hidden_size": 64, "ssm_cfg": {"conv_bias": true}})).unwrap();
        assert!(o.ssm_cfg.unwrap().conv_bias);
        for inf in [json!({"__float__": "Infinity"}), json!("Infinity"), json!("inf")] {
            let o: Outer = from_value(&json!({"hidden_size": 1, "limit": [0.0, inf]})).unwrap();
            assert_eq!(o.limit, Limit(0.0, f64::INFINITY));
        }
    }
}
