//! What the model sees of an MCP tool result: its text parts joined, its structured content
//! as JSON text, every other part described in a few words (the model cannot see an image
//! through a text outcome, but it should know one was returned), and `isError` as an error
//! outcome.
//!
//! The result is read in its wire shape (JSON), not through rmcp's content enums, so that a
//! new kind of content in a later revision is described rather than refused.

use ratchet_core::ToolOutcome;
use rmcp::model::CallToolResult;
use serde_json::Value;

pub(crate) fn outcome(result: &CallToolResult) -> ToolOutcome {
    let wire = serde_json::to_value(result).unwrap_or(Value::Null);
    let (content, is_error) = describe(&wire);
    if is_error {
        ToolOutcome::error(content)
    } else {
        ToolOutcome::ok(content)
    }
}

/// The outcome text of a `tools/call` result in its wire shape, and whether it is an error.
pub(crate) fn describe(result: &Value) -> (String, bool) {
    let is_error = result["isError"].as_bool().unwrap_or(false);
    let blocks = result["content"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    let mut parts: Vec<String> = blocks.iter().map(describe_block).collect();
    // Servers are asked to repeat structured content as JSON text for older clients: it is
    // shown once.
    if let Some(structured) = result.get("structuredContent") {
        let repeated = blocks.iter().any(|block| {
            block["type"] == "text"
                && block["text"]
                    .as_str()
                    .and_then(|text| serde_json::from_str::<Value>(text).ok())
                    .is_some_and(|parsed| &parsed == structured)
        });
        if !repeated {
            parts.push(structured.to_string());
        }
    }
    if parts.is_empty() {
        parts.push("(no content)".to_owned());
    }
    (parts.join("\n"), is_error)
}

fn describe_block(block: &Value) -> String {
    let text = |key: &str| block[key].as_str().unwrap_or_default();
    match text("type") {
        "text" => text("text").to_owned(),
        kind @ ("image" | "audio") => {
            // Base64: four characters for every three bytes.
            let bytes = text("data").len() / 4 * 3;
            format!("[{kind} {}, about {bytes} bytes]", text("mimeType"))
        }
        "resource" => {
            let resource = &block["resource"];
            let uri = resource["uri"].as_str().unwrap_or_default();
            match resource["text"].as_str() {
                Some(contents) => format!("[resource {uri}]\n{contents}"),
                None => format!(
                    "[resource {uri}, {} binary]",
                    resource["mimeType"].as_str().unwrap_or("unknown type")
                ),
            }
        }
        "resource_link" => format!("[resource link {} ({})]", text("uri"), text("name")),
        "" => "[content without a type]".to_owned(),
        other => format!("[{other} content]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_parts_are_joined_and_others_described() {
        let result = json!({
            "content": [
                {"type": "text", "text": "first"},
                {"type": "image", "data": "AAAAAAAA", "mimeType": "image/png"},
                {"type": "audio", "data": "AAAA", "mimeType": "audio/wav"},
                {"type": "resource", "resource": {"uri": "file:///a.txt", "text": "inside"}},
                {"type": "resource", "resource": {"uri": "file:///b.bin", "blob": "AAAA", "mimeType": "application/zip"}},
                {"type": "resource_link", "uri": "file:///c", "name": "c"},
                {"type": "hologram"},
                {"type": "text", "text": "last"}
            ]
        });
        assert_eq!(
            describe(&result),
            (
                "first\n[image image/png, about 6 bytes]\n[audio audio/wav, about 3 bytes]\n\
                 [resource file:///a.txt]\ninside\n[resource file:///b.bin, application/zip binary]\n\
                 [resource link file:///c (c)]\n[hologram content]\nlast"
                    .to_owned(),
                false
            )
        );
    }

    #[test]
    fn structured_content_is_shown_once_and_errors_stay_errors() {
        let structured = json!({"content": [], "structuredContent": {"sum": 3}});
        assert_eq!(describe(&structured), (r#"{"sum":3}"#.to_owned(), false));
        let repeated = json!({
            "content": [{"type": "text", "text": "{\n  \"sum\": 3\n}"}],
            "structuredContent": {"sum": 3}
        });
        assert_eq!(
            describe(&repeated),
            ("{\n  \"sum\": 3\n}".to_owned(), false)
        );
        let different = json!({
            "content": [{"type": "text", "text": "three"}],
            "structuredContent": {"sum": 3}
        });
        assert_eq!(
            describe(&different),
            ("three\n{\"sum\":3}".to_owned(), false)
        );
        let failed =
            json!({"content": [{"type": "text", "text": "no such file"}], "isError": true});
        assert_eq!(describe(&failed), ("no such file".to_owned(), true));
        assert_eq!(describe(&json!({})), ("(no content)".to_owned(), false));
    }
}
