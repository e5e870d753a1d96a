/// Search the open issues in a public GitHub repository.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, Default)]
struct search_github_issues;
const _: () = {
    use ::flue_runtime::__private::flue_core as __flue;
    #[derive(
        ::flue_runtime::__private::serde::Deserialize,
        ::flue_runtime::__private::schemars::JsonSchema
    )]
    #[serde(crate = "::flue_runtime::__private::serde")]
    #[schemars(crate = "::flue_runtime::__private::schemars")]
    #[allow(non_camel_case_types)]
    struct __FlueToolArgs_search_github_issues {
        /// Repository owner
        owner: String,
        /// Words from the issue title or text
        query: String,
    }
    #[allow(dead_code, unused_variables)]
    async fn __flue_tool_body(
        ctx: &ToolContext,
        owner: String,
        query: String,
    ) -> Result<String, ToolError> {
        Ok(format!("{owner}: {query}"))
    }
    #[automatically_derived]
    impl __flue::tool::ToolHandler for search_github_issues {
        fn definition(&self) -> &__flue::tool::ToolDefinition {
            static DEFINITION: __flue::tool::ToolDefinition = __flue::tool::ToolDefinition::from_checked(
                "search_github_issues",
                "Search the open issues in a public GitHub repository.",
                __flue::data::SchemaSource::Typed(
                    __flue::tool::arguments::<__FlueToolArgs_search_github_issues>()
                        .schema,
                ),
                ::core::option::Option::Some("query"),
                &["GITHUB_TOKEN"],
                false,
            );
            &DEFINITION
        }
        fn call(
            &self,
            ctx: __flue::ToolContext,
            args: ::flue_runtime::__private::serde_json::Value,
        ) -> __flue::BoxFuture<'_, __flue::ToolOutput> {
            ::std::boxed::Box::pin(async move {
                let args: __FlueToolArgs_search_github_issues = match (__flue::tool::arguments::<
                    __FlueToolArgs_search_github_issues,
                >()
                    .parse)(args)
                {
                    ::core::result::Result::Ok(args) => args,
                    ::core::result::Result::Err(output) => return output,
                };
                let _ = &ctx;
                __flue::tool::tool_return::<
                    Result<String, ToolError>,
                >(__flue_tool_body(&ctx, args.owner, args.query).await)
            })
        }
    }
};
