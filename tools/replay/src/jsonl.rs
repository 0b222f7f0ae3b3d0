//! JSON objects with their fields in a chosen order. serde_json's `Map` sorts
//! keys (no `preserve_order` feature here), which puts `t_ms` after
//! `messages` and `index` in the middle of a record; people read these files
//! with `head` and `jq -c`, so the order is worth a few lines.

use serde_json::Value;

/// `{"a":1,"b":2}` with the fields in the order given.
pub fn object(fields: &[(&str, Value)]) -> String {
    let mut out = String::from("{");
    for (i, (name, value)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Serialising a string or a `Value` cannot fail.
        out.push_str(&serde_json::to_string(name).unwrap_or_default());
        out.push(':');
        out.push_str(&serde_json::to_string(value).unwrap_or_default());
    }
    out.push('}');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn keeps_order_and_escapes() {
        let line = object(&[("z", json!(1)), ("a\"", json!("x\ny")), ("m", json!(null))]);
        assert_eq!(line, r#"{"z":1,"a\"":"x\ny","m":null}"#);
        let back: Value = serde_json::from_str(&line).expect("valid JSON");
        assert_eq!(back["a\""], "x\ny");
        assert_eq!(object(&[]), "{}");
    }
}
